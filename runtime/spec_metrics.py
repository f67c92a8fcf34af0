"""Per-request speculation stats in vLLM's shape (vllm-project/vllm#48915), read by AIPerf.

``speculative_decoding`` turns what a request's decodes counted (DecodeStats: one per choice)
into the ``metrics.speculative_decoding`` object vLLM adds to a response under
``--per-request-spec-decode-metrics``, with its names and meanings:

- ``num_spec_tokens``: the most drafts a round may offer this request (k);
- ``num_spec_steps``: verify rounds, every round of the request (a round at depth 0 too: it
  is a verify pass of one token, so E[L] below is tokens per target pass, what the speedup
  equation reads);
- ``num_draft_tokens`` / ``num_accepted_draft_tokens``: drafts offered / kept;
- ``draft_acceptance_rate``: kept / offered (0 when nothing was offered);
- ``mean_acceptance_length``: 1 + kept / rounds;
- ``acceptance_histogram``: [k + 1], entry j the rounds that kept exactly j drafts.

``detailed`` adds each round's drafts and kept drafts (``per_step_draft_tokens``,
``per_step_accepted``), in order (for n choices, choice by choice). Counts follow DecodeStats, as
the server's /metrics counters do: a round cut by a stop counts its drafts up to the stop only,
and a tree round counts its depth as its drafts.
"""

from __future__ import annotations

from collections.abc import Iterable

from specexport.runtime.stats import DecodeStats

LEVELS = ("summary", "detailed")  # --per-request-spec-decode-metrics


def speculative_decoding(stats: Iterable[DecodeStats], detailed: bool = False) -> dict:
    """The object for a request whose choices decoded with ``stats``."""
    stats = list(stats)
    k = max((s.draft_len for s in stats), default=0)
    drafts = [d for s in stats for d in s.round_drafts]  # [rounds]
    accepted = [a for s in stats for a in s.round_accepted]  # [rounds]
    steps, offered, kept = len(accepted), sum(drafts), sum(accepted)
    histogram = [0] * (k + 1)
    for a in accepted:
        histogram[a] += 1
    out = {
        "mean_acceptance_length": 1.0 + kept / steps if steps else 0.0,
        "draft_acceptance_rate": kept / offered if offered else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": kept,
        "num_draft_tokens": offered,
        "num_spec_tokens": k,
    }
    if detailed:
        out["per_step_draft_tokens"] = drafts
        out["per_step_accepted"] = accepted
    return out
