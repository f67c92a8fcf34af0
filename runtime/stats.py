"""What a decode did: tokens, rounds, drafts offered and kept, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    accepted_at: list[int] = field(default_factory=list)  # [D] rounds that kept draft position i (longer past D)
    round_drafts: list[int] = field(default_factory=list)  # [rounds] drafts each round offered (a tree: its depth)
    round_accepted: list[int] = field(default_factory=list)  # [rounds] of them kept
    proposed_at: list[int] = field(default_factory=list)  # [D] rounds that offered position i
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter wall time in rounds (its engines and its host work)
    draft_engine_s: float = 0.0  # of which inside the drafter's engines
    verify_s: float = 0.0  # target engine time in rounds
    total_s: float = 0.0  # the rounds' wall time, prefill excluded
    rules_s: float = 0.0  # of host time: logits rules and grammar masks (runtime/rules.py)
    ruled_rows: int = 0  # rows they ruled
    tree_nodes: int = 0  # draft nodes verified in tree rounds (runtime/tree.py)
    verified_tokens: int = 0  # rows the verify passes ran for this sequence (1 + its drafts or tree nodes)
    priced_rounds: int = 0  # rounds the speculation policy had a price for (runtime/round_prices.py)
    priced_s: float = 0.0  # their prices, summed
    priced_measured_s: float = 0.0  # and what they took
    stop_reason: str = ""

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.draft_len
        self.proposed_at = [0] * self.draft_len

    def count_round(self, proposed: int, accepted: int, emitted: int) -> None:
        """One verify round that offered ``proposed`` drafts (a tree: its depth), kept ``accepted``
        and emitted ``emitted`` tokens (accepted + 1, or fewer when a stop cut it)."""
        if emitted <= accepted:  # a stop inside the accepted drafts: the round ends there
            proposed = accepted = emitted
        self.rounds += 1
        self.tokens += emitted
        self.proposed += proposed
        self.accepted += accepted
        self.round_drafts.append(proposed)
        self.round_accepted.append(accepted)
        if proposed > len(self.proposed_at):  # a long drafter's round past D (runtime/policy.py)
            grow = [0] * (proposed - len(self.proposed_at))
            self.proposed_at, self.accepted_at = self.proposed_at + grow, self.accepted_at + grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

    def count_price(self, priced: float | None, seconds: float) -> None:
        """A round the policy priced at ``priced`` seconds (None: no price) took ``seconds``."""
        if priced is not None:
            self.priced_rounds += 1
            self.priced_s += priced
            self.priced_measured_s += seconds

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
            "rules_s": self.rules_s,
            "tree_nodes": self.tree_nodes,
            "verified_tokens": self.verified_tokens,
            "priced_rounds": self.priced_rounds,
            "priced_ms_per_round": 1e3 * self.priced_s / self.priced_rounds if self.priced_rounds else None,
            "measured_ms_per_round": 1e3 * self.priced_measured_s / self.priced_rounds if self.priced_rounds else None,
            "ruled_rows": self.ruled_rows,
            "stop_reason": self.stop_reason,
        }
