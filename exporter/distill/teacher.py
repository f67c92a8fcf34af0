"""What the target says about each training sequence: its tapped hidden states and its
next-token distribution, computed by one forward pass (transformers, ``output_hidden_states``).

Per sequence of T tokens (the teacher's rows, as tensors on the CPU):

- ``aux`` [T, n_taps·H]: ``hidden_states[i]`` for each tap i (the stream entering layer i, the
  project's convention), concatenated in the head's order;
- ``top_idx`` [T, K] int64 draft ids and ``top_p`` [T, K] float32: the target's distribution of
  the NEXT token restricted to the draft vocabulary, its top K kept and renormalised;
- ``amax`` [T] int64: the target's argmax over the full vocabulary (the token greedy decoding
  commits; a draft is accepted when it equals it).

Rows are computed when a batch asks for them and kept on disk (one safetensors file per
sequence) while the cache stays under its size cap; past the cap they are recomputed each
time. Nothing holds every sequence's rows in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specexport.exporter.distill.data import Sequences

FIELDS = ("aux", "top_idx", "top_p", "amax")


class Teacher:
    def __init__(self, model, taps: tuple[int, ...], draft_ids: np.ndarray, topk: int, device: torch.device,
                 cache_dir: Path, cache_bytes: int, batch_tokens: int):
        self.model, self.taps, self.device = model, taps, device
        self.draft = torch.from_numpy(draft_ids).to(device)  # [V_draft] target ids
        self.topk = min(topk, len(draft_ids))
        self.cache_dir, self.cache_bytes, self.batch_tokens = cache_dir, cache_bytes, batch_tokens
        self.aux_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.used = 0
        self.cached: set[int] = set()
        self.computed_tokens = 0  # teacher forward work, for the record

    def rows(self, seqs: Sequences, members: list[int]) -> list[dict[str, torch.Tensor]]:
        """The teacher's rows of each member sequence, in order."""
        from safetensors.torch import load_file

        found: dict[int, dict[str, torch.Tensor]] = {}
        for i in members:
            if i in self.cached:
                found[i] = load_file(str(self._path(i)))
        missing = [i for i in members if i not in found]
        for chunk in self._chunks(seqs, missing):
            for i, rows in zip(chunk, self._forward(seqs, chunk)):
                found[i] = rows
                self._store(i, rows)
        return [found[i] for i in members]

    def _path(self, i: int) -> Path:
        return self.cache_dir / f"{i}.safetensors"

    def _store(self, i: int, rows: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        size = sum(t.numel() * t.element_size() for t in rows.values())
        if self.used + size > self.cache_bytes:
            return
        save_file({k: v.contiguous() for k, v in rows.items()}, str(self._path(i)))
        self.used += size
        self.cached.add(i)

    def _chunks(self, seqs: Sequences, members: list[int]) -> list[list[int]]:
        """Members in groups of similar lengths under the teacher's padded-token budget."""
        order = sorted(members, key=lambda i: len(seqs.ids[i]))
        out: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            if cur and (len(cur) + 1) * len(seqs.ids[i]) > self.batch_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        return out + ([cur] if cur else [])

    @torch.no_grad()
    def _forward(self, seqs: Sequences, chunk: list[int]) -> list[dict[str, torch.Tensor]]:
        lengths = [len(seqs.ids[i]) for i in chunk]
        ids = torch.zeros(len(chunk), max(lengths), dtype=torch.long)  # [b, T] right-padded (causal: safe)
        for r, i in enumerate(chunk):
            ids[r, : lengths[r]] = torch.from_numpy(seqs.ids[i])
        out = self.model(ids.to(self.device), use_cache=False, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[t] for t in self.taps], dim=-1)  # [b, T, n·H]
        logits = out.logits.float()  # [b, T, V]
        amax = logits.argmax(-1)  # [b, T]
        restricted = torch.log_softmax(logits.index_select(-1, self.draft), dim=-1)  # [b, T, V_draft]
        del out, logits
        top_v, top_i = restricted.topk(self.topk, dim=-1)  # [b, T, K]
        top_p = torch.softmax(top_v, dim=-1)  # renormalised over the kept K
        self.computed_tokens += sum(lengths)
        return [{"aux": aux[r, :n].to(self.aux_dtype).cpu(), "top_idx": top_i[r, :n].cpu(),
                 "top_p": top_p[r, :n].cpu(), "amax": amax[r, :n].cpu()} for r, n in enumerate(lengths)]
