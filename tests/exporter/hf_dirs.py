"""Local transformers directories (safetensors + tokenizer) made from tiny random models."""

from __future__ import annotations

from pathlib import Path


def save_tiny_hf(path: Path, arch: str = "llama", *, seed: int = 0, shuffle_vocab: bool = False,
                 embedding_rows: int | None = None, **fields) -> Path:
    """``shuffle_vocab``: the same vocabulary size, another token->id map. ``embedding_rows``: an
    embedding table (and tied head) of that many rows, the tokenizer unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import CHAT_TEMPLATE, SPECIALS, tiny_model

    model, tokenizer = tiny_model(TinySource(source="tiny", arch=arch, seed=seed, **fields))
    if shuffle_vocab:
        # same size, same specials, the byte tokens in reverse order
        vocab = tokenizer.get_vocab()
        specials = {t: i for t, i in vocab.items() if t in SPECIALS}
        plain = sorted((t for t in vocab if t not in SPECIALS), key=vocab.get)
        shuffled = {**specials, **{t: len(specials) + i for i, t in enumerate(reversed(plain))}}
        core = Tokenizer(models.BPE(vocab=shuffled, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.decoder = decoders.ByteLevel()
        core.add_special_tokens(SPECIALS)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>",
                                            eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                            chat_template=CHAT_TEMPLATE)
    if embedding_rows is not None:
        model.resize_token_embeddings(embedding_rows)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
