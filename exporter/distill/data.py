"""Training sequences: the target's own responses to a prompt set, plus optional local text.

Inputs (JSONL, one object a line; errors name the file and the line):

- ``--prompts FILE``: the bench's format, ``{"messages": [...]}`` (the target's chat template,
  with the generation prompt) or ``{"prompt": "..."}`` (raw text). The target answers each
  one itself: greedy, plus ``samples`` sampled answers per training prompt.
- ``--data FILE``: ``{"text": "..."}`` (every token is trained on) or ``{"messages": [...,
  {"role": "assistant", ...}]}`` (the last assistant turn is trained on, the rest is context).

A sequence is prompt + response token ids; ``start`` is where the response begins (its tokens
are the ones the head learns to draft). The held-out split is by prompt (or data line).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import BadInput


@dataclass
class Sequences:
    """Every training and held-out sequence, as token ids (small: no tensors of the target)."""

    ids: list[np.ndarray] = field(default_factory=list)  # each [T] int64: prompt + response
    start: list[int] = field(default_factory=list)  # first response position
    holdout: list[bool] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)  # the target's own greedy response

    def add(self, ids: np.ndarray, start: int, holdout: bool, greedy: bool) -> None:
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.start.append(int(start))
        self.holdout.append(bool(holdout))
        self.greedy.append(bool(greedy))

    def __len__(self) -> int:
        return len(self.ids)

    def members(self, holdout: bool, greedy_only: bool = False) -> list[int]:
        return [i for i in range(len(self)) if self.holdout[i] == holdout and (self.greedy[i] or not greedy_only)]

    def to_arrays(self) -> dict[str, np.ndarray]:
        lengths = np.array([len(x) for x in self.ids], dtype=np.int64)
        return {
            "ids": np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64),
            "offsets": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            "start": np.array(self.start, dtype=np.int64),
            "holdout": np.array(self.holdout, dtype=np.uint8),
            "greedy": np.array(self.greedy, dtype=np.uint8),
        }

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> Sequences:
        out = cls()
        off = a["offsets"]
        for i in range(len(off) - 1):
            out.add(a["ids"][off[i] : off[i + 1]], int(a["start"][i]), bool(a["holdout"][i]), bool(a["greedy"][i]))
        return out

    def stats(self) -> dict:
        resp = [len(x) - s for x, s in zip(self.ids, self.start)]
        return {"sequences": len(self), "held_out": sum(self.holdout), "greedy": sum(self.greedy),
                "tokens": int(sum(len(x) for x in self.ids)), "response_tokens": int(sum(resp)),
                "mean_response": round(float(np.mean(resp)), 1) if resp else 0.0}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_jsonl(path: Path, option: str) -> list[tuple[int, dict]]:
    """(line number, object) of every non-blank line; a bad line is a one-line error."""
    if not path.is_file():
        raise BadInput(f"{option} {path}: file not found")
    items = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{option} {path}: cannot read it: {err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as err:
            raise BadInput(f"{path}:{number}: not a JSON object ({err})") from None
        if not isinstance(item, dict):
            raise BadInput(f"{path}:{number}: each line must be a JSON object")
        items.append((number, item))
    if not items:
        raise BadInput(f"{option} {path}: the file holds no lines")
    return items


def check_lines(items: list[tuple[int, dict]], path: Path, option: str) -> None:
    """Each line's shape (before the target is loaded): --prompts lines need 'messages' or
    'prompt'; --data lines 'text' or 'messages' ending with an assistant turn."""
    for number, item in items:
        where = f"{path}:{number}"
        if "messages" in item:
            messages = _messages(item, where)
            if option == "--data" and messages[-1]["role"] != "assistant":
                raise BadInput(f"{where}: a chat line must end with an 'assistant' message (the text trained on)")
        elif option == "--prompts" and not isinstance(item.get("prompt"), str):
            raise BadInput(f"{where}: each line needs 'messages' (chat) or 'prompt' (text)")
        elif option == "--data" and not isinstance(item.get("text"), str):
            raise BadInput(f"{where}: each line needs 'text' or 'messages'")


def _messages(item: dict, where: str) -> list[dict]:
    messages = item["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadInput(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    return messages


def _chat(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(f"{where}: the target's tokenizer has no chat template; give 'prompt' or 'text' lines")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_ids(tokenizer, items: list[tuple[int, dict]], path: Path) -> list[np.ndarray]:
    """Token ids of each prompt line: ``messages`` through the chat template, ``prompt`` raw."""
    out = []
    for number, item in items:
        where = f"{path}:{number}"
        if "messages" in item:
            ids = _chat(tokenizer, _messages(item, where), True, where)
        elif isinstance(item.get("prompt"), str):
            ids = list(tokenizer(item["prompt"]).input_ids)
        else:
            raise BadInput(f"{where}: each line needs 'messages' (chat) or 'prompt' (text)")
        if not ids:
            raise BadInput(f"{where}: the prompt is empty")
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def data_sequences(tokenizer, items: list[tuple[int, dict]], path: Path, max_len: int) -> list[tuple[np.ndarray, int]]:
    """(ids, start) of each --data line, cut to ``max_len`` tokens."""
    out = []
    for number, item in items:
        where = f"{path}:{number}"
        if isinstance(item.get("text"), str):
            ids, start = list(tokenizer(item["text"]).input_ids), 1
        elif "messages" in item:
            messages = _messages(item, where)
            if messages[-1]["role"] != "assistant":
                raise BadInput(f"{where}: a chat line must end with an 'assistant' message (the text trained on)")
            start = len(_chat(tokenizer, messages[:-1], True, where))
            ids = _chat(tokenizer, messages, False, where)
        else:
            raise BadInput(f"{where}: each line needs 'text' or 'messages'")
        ids = ids[:max_len]
        if len(ids) - max(start, 1) < 2:
            raise BadInput(f"{where}: fewer than 2 tokens to train on")
        out.append((np.asarray(ids, dtype=np.int64), max(start, 1)))
    return out


def split_holdout(n: int, fraction: float, rng: random.Random) -> set[int]:
    """Indices held out: ``fraction`` of ``n`` (at least one when n > 1, never all)."""
    if n < 2 or fraction <= 0:
        return set()
    k = min(max(1, round(n * fraction)), n - 1)
    return set(rng.sample(range(n), k))


def generate(model, prompts: list[np.ndarray], *, max_new: int, batch: int, temperature: float,
             eos_ids: list[int], pad_id: int, seed: int, device, deadline: float | None = None,
             on_batch: Callable[[int, int], None] | None = None) -> list[np.ndarray | None]:
    """The target's responses (ids after the prompt, up to and including EOS), batched over
    left-padded prompts of similar lengths. Past ``deadline`` (time.time()) the remaining
    prompts get None. ``temperature`` 0: greedy."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[np.ndarray | None] = [None] * len(prompts)
    generator_seed = seed
    for k in range(0, len(order), batch):
        if deadline is not None and time.time() > deadline and k > 0:
            break
        chunk = order[k : k + batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [b, width] left-padded
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            ids[r, width - len(prompts[i]) :] = torch.from_numpy(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        torch.manual_seed(generator_seed + k)  # transformers samples from the global generator
        with torch.no_grad():
            new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                                 pad_token_id=pad_id, eos_token_id=eos_ids, **sampling)[:, width:].cpu().numpy()
        for r, i in enumerate(chunk):
            row = new[r]
            ends = np.flatnonzero(np.isin(row, eos_ids))
            out[i] = row[: ends[0] + 1] if len(ends) else row
        if on_batch is not None:
            on_batch(min(k + batch, len(order)), len(order))
    return out


def _response_counts(seqs: Sequences, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, dtype=np.int64)  # [V] response tokens of the training sequences
    for i in seqs.members(holdout=False):
        np.add.at(counts, seqs.ids[i][seqs.start[i] :], 1)
    return counts


def vocab_coverage(seqs: Sequences, vocab: int, draft_ids: np.ndarray) -> dict:
    """The share of training response tokens a given draft vocabulary holds (``--init``'s)."""
    counts = _response_counts(seqs, vocab)
    coverage = round(float(counts[draft_ids].sum()) / max(int(counts.sum()), 1), 5)
    return {"draft_vocab": int(len(draft_ids)), "response_coverage": coverage}


def choose_vocab(seqs: Sequences, vocab: int, size: int) -> tuple[np.ndarray, dict]:
    """The ``size`` most frequent response tokens of the training sequences (ties: lower id),
    sorted ascending: draft id i is target id ``draft_ids[i]`` (d2t[i] = draft_ids[i] - i).
    Also the response-token coverage of the chosen size."""
    counts = _response_counts(seqs, vocab)
    size = min(size, vocab)
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id
    total = max(int(counts.sum()), 1)
    coverage = round(float(counts[order[:size]].sum()) / total, 5)
    return np.sort(order[:size]).astype(np.int64), {"draft_vocab": int(size), "response_coverage": coverage}
