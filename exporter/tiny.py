"""Tiny random-weight models and a byte-level tokenizer: real architectures, no download.

Used by tests and examples (``source: tiny``). The tokenizer maps every byte to one token, plus
three ChatML specials, so any text round-trips and the vocabulary stays small (259).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from specexport.errors import BadInput
from specexport.exporter.archs import ARCHITECTURES
from specexport.exporter.recipe import TinySource

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The recipe names families; transformers names text-only Gemma 3 "gemma3_text".
_CONFIG_NAMES = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_RECIPE_NAMES = {config: recipe for recipe, config in _CONFIG_NAMES.items()}
# Embedding rows of norm ~4: logits spread by a few units, so argmax has clear margins.
EMBED_STD_SCALE = 4.0
# MoE settings of the tiny DeepSeek-V3 / GLM-4.5 models: 4 experts in 2 groups, top-2 within the
# best group, a shared expert, the first layer dense.
_TINY_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                 first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5)


def _tiny_moe_config(src: TinySource, head_dim: int) -> dict:
    return {**_TINY_MOE, "moe_intermediate_size": src.intermediate_size // 4}


def _tiny_glm4_moe_config(src: TinySource, head_dim: int) -> dict:
    # GLM-4.5: q/k/v biases, half the head rotated
    return {**_tiny_moe_config(src, head_dim), "attention_bias": True, "partial_rotary_factor": 0.5}


def _tiny_deepseek_v3_config(src: TinySource, head_dim: int) -> dict:
    # MLA: every head its own K/V; v_head_dim below the qk width (nope + rope, a multiple of 16 as
    # onnxruntime's GroupQueryAttention wants); interleaved RoPE
    return {**_tiny_moe_config(src, head_dim), "num_key_value_heads": src.num_attention_heads,
            "q_lora_rank": src.hidden_size // 2, "kv_lora_rank": src.hidden_size // 2,
            "qk_nope_head_dim": head_dim + head_dim // 2, "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim,
            "head_dim": head_dim // 2, "rope_interleave": True}  # DeepseekV3Config's head_dim: the rotary width


def _tiny_linear_attention_config(src: TinySource, head_dim: int) -> dict:
    # Qwen3-Next / Qwen3.5: linear-attention (Gated DeltaNet) layers with a full-attention layer
    # every second one; more value heads than key heads (the k heads are repeated), a kernel-4
    # convolution; a quarter of each attention head rotated (their default)
    layer_types = ["full_attention" if i % 2 else "linear_attention" for i in range(src.num_layers)]
    return dict(layer_types=layer_types, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4)


def _tiny_qwen_moe_config(src: TinySource, head_dim: int) -> dict:
    # Qwen3-Next / Qwen3.5-MoE: softmax-routed experts (top-2 of 4) beside a gated shared expert
    return {**_tiny_linear_attention_config(src, head_dim), "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": src.intermediate_size // 4,
            "shared_expert_intermediate_size": src.intermediate_size // 4, "norm_topk_prob": True,
            "decoder_sparse_step": 1}


# model_type -> its extra config fields
_TINY_EXTRAS = {"glm4_moe": _tiny_glm4_moe_config, "deepseek_v3": _tiny_deepseek_v3_config,
                "qwen3_next": _tiny_qwen_moe_config, "qwen3_5_text": _tiny_linear_attention_config,
                "qwen3_5_moe_text": _tiny_qwen_moe_config}
# 1-D weights applied as they are (near 1) even in a model whose other norms scale by 1 + w:
# the linear-attention layers' gated norm (Qwen3NextRMSNormGated)
_PLAIN_NORMS = ("linear_attn.norm.weight",)
# a router's logits should spread by a unit or so (sigmoid scores without exact ties), and its
# score-correction bias (a buffer, zero at init) should matter
ROUTER_STD = 0.15
SCORE_BIAS_STD = 0.1


def byte_tokenizer():
    """A transformers fast tokenizer over bytes: ids 0-2 are specials, 3-258 the 256 bytes."""
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # 256 printable stand-ins for the bytes
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(src: TinySource, vocab_size: int, overrides: dict | None = None):
    """``overrides``: config fields to set last (tests of an architecture's variants)."""
    from transformers import AutoConfig

    model_type = _CONFIG_NAMES.get(src.arch, src.arch)
    if model_type not in ARCHITECTURES:
        raise BadInput(
            f"target.arch: '{src.arch}' is not supported for tiny models; supported: "
            + ", ".join(sorted({_RECIPE_NAMES.get(k, k) for k in ARCHITECTURES}))
        )
    if src.num_attention_heads % src.num_key_value_heads:
        raise BadInput("num_attention_heads must be a multiple of num_key_value_heads")
    head_dim = src.head_dim or src.hidden_size // src.num_attention_heads
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    if model_type == "qwen2":
        kwargs["use_sliding_window"] = False
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    if model_type in ("qwen2", "gemma2", "gemma3_text", "phi3"):
        # an untied output head exercises the separate lm_head path (and keeps Gemma's
        # sandwich-normed stream from collapsing onto one token with a tied head)
        kwargs["tie_word_embeddings"] = False
    if model_type in ("gemma2", "gemma3_text"):
        # Alternate sliding and full layers with a short window, so the tests reach it.
        kwargs["sliding_window"] = 16
        kwargs["query_pre_attn_scalar"] = head_dim
    if model_type == "phi3":
        kwargs["pad_token_id"] = 0
    if model_type in _TINY_EXTRAS:
        kwargs.update(_TINY_EXTRAS[model_type](src, head_dim))
    kwargs.update(overrides or {})
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(src: TinySource, overrides: dict | None = None):
    """Return (model, tokenizer): a random-weight causal LM over the byte tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    config = tiny_config(src, vocab_size=len(tokenizer), overrides=overrides)
    generator = torch.Generator().manual_seed(src.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Gemma scales embeddings by sqrt(hidden); undo it so the residual stream is not just
    # the input token (the model would only ever repeat it).
    embed_scale = float(getattr(model.model.embed_tokens, "scalar_embed_scale", 1.0))
    embed_std = EMBED_STD_SCALE / config.hidden_size**0.5 / embed_scale**0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                std = embed_std if "embed" in name else ROUTER_STD if name.endswith("mlp.gate.weight") else src.init_std
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                # norms and biases: near their identity, with a little spread
                offset = model_type_uses_offset(config) and not name.endswith(_PLAIN_NORMS)
                base = 0.0 if ("bias" in name or offset) else 1.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * SCORE_BIAS_STD)
    return model.eval(), tokenizer


def model_type_uses_offset(config) -> bool:
    return ARCHITECTURES[config.model_type].norm_offset != 0.0
