"""The speculative decode loop: prefill, then rounds of draft -> verify -> accept -> commit.

Cache invariant: the target's cache holds every committed token but the last one. A round
feeds [last, d1..dk] through the target's verify graph, so the outputs at those 1+k positions
give the target's choice after each prefix; the accepted drafts and the next token are
committed, and the cache is rewound to drop the rejected drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.acceptance import EMPTY_DRAFT, Sampling, Warped, greedy, rejection
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafters import Drafter
from specexport.runtime.runner import ModelRunner


@dataclass
class DecodeStats:
    """What a decode did, counted by what it emitted: a round cut short by a stop (EOS inside
    the accepted drafts, a stop string, max_new_tokens) counts only its drafts up to the stop,
    as proposed and as accepted; the drafts after it were never output."""

    draft_len: int
    rounds: int = 0
    tokens: int = 0  # generated tokens
    proposed: int = 0  # draft tokens offered to the target
    accepted: int = 0  # draft tokens the target kept
    accepted_at: list[int] = field(default_factory=list)  # [D] rounds that kept draft position i
    proposed_at: list[int] = field(default_factory=list)  # [D] rounds that offered position i
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter wall time in rounds (its engines and its host work)
    draft_engine_s: float = 0.0  # of which inside the drafter's engines
    verify_s: float = 0.0  # target engine time in rounds
    total_s: float = 0.0  # the rounds' wall time, prefill excluded
    stop_reason: str = ""

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.draft_len
        self.proposed_at = [0] * self.draft_len

    def count_round(self, proposed: int, accepted: int, emitted: int) -> None:
        """One verify round that offered ``proposed`` drafts, kept ``accepted`` and emitted
        ``emitted`` tokens (accepted + 1, or fewer when a stop cut it)."""
        if emitted <= accepted:  # a stop inside the accepted drafts: the round ends there
            proposed = accepted = emitted
        self.rounds += 1
        self.tokens += emitted
        self.proposed += proposed
        self.accepted += accepted
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def draft_host_s(self) -> float:
        return max(self.draft_s - self.draft_engine_s, 0.0)

    @property
    def host_s(self) -> float:
        """Everything outside the engines: the loop, warping and sampling, the drafter's host work."""
        return max(self.total_s - self.draft_engine_s - self.verify_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s else 0.0

    @property
    def acceptance_length(self) -> float:
        """E[L]: tokens committed per verify round (accepted drafts + the target's token)."""
        return self.tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tokens": self.tokens,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "acceptance_by_position": [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "draft_engine_s": self.draft_engine_s,
            "draft_host_s": self.draft_host_s,
            "verify_s": self.verify_s,
            "host_s": self.host_s,
            "total_s": self.total_s,
            "host_fraction": self.host_s / self.total_s if self.total_s else 0.0,
            "tokens_per_s": self.tokens_per_s,
            "stop_reason": self.stop_reason,
        }


def decode(target: ModelRunner, drafter: Drafter, prompt: np.ndarray, *, draft_len: int, max_new_tokens: int,
           sampling: Sampling, eos_ids: frozenset[int], rng: np.random.Generator,
           stop: Callable[[int], bool] | None = None, stats: DecodeStats,
           policy: DepthPolicy | None = None) -> Iterator[int]:
    """Yield tokens as the target accepts them; ``stats`` is filled in as it goes.

    ``policy`` (adaptive depth) chooses each round's depth up to ``draft_len`` from measured
    costs and acceptance; without it every round drafts ``draft_len`` tokens.

    ``stop(token)`` sees each token of a round, in order, before the round's tokens are
    yielded (to detokenize and match stop strings); True ends decoding after that token."""
    capacity = target.cache.max_seq_len
    context = np.zeros(capacity + 1, dtype=np.int64)  # committed tokens: prompt + output
    length = len(prompt)
    context[:length] = prompt

    start = time.perf_counter()
    target.rewind(0)
    # chunked prefill; the last prompt token opens round one. A drafter that reads the target's
    # hidden states gets them for the prompt (drafter.needs names them).
    prefill = target.forward(prompt[:-1], want=drafter.needs)
    drafter.reset(prompt, prefill.extras)
    stats.prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    try:
        while True:
            if length > capacity:
                stats.stop_reason = "kv_full"
                return
            # The target cache will hold length-1 tokens + the 1+k fed: 1+k <= capacity-length+1.
            k = min(draft_len, capacity - length, max_new_tokens - stats.tokens - 1)

            if policy is not None:
                k = policy.best_depth(drafter.name, k)
            engine_before = drafter.engine_seconds
            t0 = time.perf_counter()
            draft = drafter.propose(context[:length], k, sampling, rng) if k > 0 else EMPTY_DRAFT
            stats.draft_s += time.perf_counter() - t0
            if policy is not None:
                draft = policy.trim(draft, drafter.name)

            verify_before = target.seconds
            out = target.forward(np.concatenate((context[length - 1 : length], draft.tokens)),
                                 want_logits=not sampling.greedy, want=drafter.needs)
            stats.verify_s += target.seconds - verify_before

            if sampling.greedy:
                n_accepted, next_token = greedy(draft.tokens, out.next_tokens)
            else:
                n_accepted, next_token = rejection(draft, Warped(out.logits, sampling), rng)  # rows warped as read
            target.rewind(length + n_accepted)  # keep last + accepted drafts; drop the rest

            t0 = time.perf_counter()
            # the drafter sees the target's outputs of the committed positions only
            drafter.accept(n_accepted, next_token, {name: rows[: 1 + n_accepted] for name, rows in out.extras.items()})
            stats.draft_s += time.perf_counter() - t0
            stats.draft_engine_s += drafter.engine_seconds - engine_before
            if policy is not None:
                policy.update(draft.tag or drafter.name, draft.size, n_accepted)

            # Where the round's tokens stop (EOS, a stop string, the token budget) is decided
            # before any is yielded, so the stats count exactly the tokens emitted.
            emitted = 0
            for token in (*draft.tokens[:n_accepted].tolist(), next_token):
                context[length] = token
                length += 1
                emitted += 1
                stopped = stop is not None and stop(token)
                stats.stop_reason = ("eos" if token in eos_ids else "stop_string" if stopped
                                     else "max_new_tokens" if stats.tokens + emitted >= max_new_tokens else "")
                if stats.stop_reason:
                    break
            stats.count_round(draft.size, n_accepted, emitted)
            yield from context[length - emitted : length].tolist()
            if stats.stop_reason:
                return
    finally:
        stats.total_s = time.perf_counter() - start
