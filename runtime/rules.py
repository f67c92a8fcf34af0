"""Logits rules: what a request changes in the target's logits before choosing a token, applied
position by position inside a verify pass, so speculation stays exact.

A rule is a function of the committed context. Row i of a verify pass scores the token after
the committed tokens and drafts 1..i, so it is ruled with exactly that prefix; the acceptance
rule (greedy or rejection) then compares the drafts with the ruled target, which makes the
output the ruled target's, as if it decoded alone. Where a drafter samples, it rules its own
logits the same way before drawing (``DraftRow.q``), which only raises acceptance: rejection
sampling is exact for any q a draft was really drawn from.

The rules, in the order they apply (vLLM's order; OpenAI's definitions):
1. grammar: tokens the request's grammar forbids get -inf (runtime/grammar.py);
2. min_tokens: end-of-sequence tokens get -inf until that many tokens are out;
3. logit_bias: logits[t] += bias[t];
4. repetition_penalty r (HF, vLLM; over prompt and output): a seen token's logit x becomes
   x / r if x > 0 else x · r;
5. frequency and presence penalties (OpenAI; over the output): logits[t] -= frequency ·
   count[t] + presence · (count[t] > 0).
Temperature, min_p, top-k and top-p then warp the ruled logits (acceptance.warp_row).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specexport.errors import BadInput
from specexport.runtime.grammar import GrammarSpec, GrammarState
from specexport.runtime.tree import DraftTree

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class Penalties:
    """A request's penalties and biases (the neutral values change nothing)."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not (np.isfinite(self.repetition) and self.repetition > 0):
            raise BadInput(f"repetition_penalty: must be > 0 (got {self.repetition})")
        for name, value in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not -2.0 <= value <= 2.0:
                raise BadInput(f"{name}: must be between -2 and 2 (got {value})")
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise BadInput(f"logit_bias: token {token}'s bias must be between -100 and 100 (got {bias})")
        if self.min_tokens < 0:
            raise BadInput(f"min_tokens: must be >= 0 (got {self.min_tokens})")

    @property
    def neutral(self) -> bool:
        return (self.repetition == 1.0 and self.frequency == 0.0 and self.presence == 0.0
                and not self.logit_bias and self.min_tokens == 0)

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t in self.logit_bias if not 0 <= t < vocab]
        if bad:
            raise BadInput(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


@dataclass(frozen=True)
class Controls:
    """What a request asks of its output beyond sampling: penalties and biases, a grammar, and
    log probabilities (None: none; k: each token's and the k most likely, runtime/logprobs.py)."""

    penalties: Penalties = field(default_factory=Penalties)
    grammar: GrammarSpec | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadInput(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS} (got {self.logprobs})")

    @property
    def rules_logits(self) -> bool:
        """Whether any rule changes the target's logits."""
        return self.grammar is not None or not self.penalties.neutral


class SequenceRules:
    """One sequence's rules: its penalties, its prompt (the repetition penalty reads it), its
    end-of-sequence ids and its grammar state. ``apply(logits, output)`` rules one row given
    every output token before it (committed and drafts)."""

    def __init__(self, penalties: Penalties, prompt: np.ndarray, eos_ids: frozenset[int],
                 grammar: GrammarState | None = None):
        self.penalties, self.eos_ids, self.grammar = penalties, np.array(sorted(eos_ids), dtype=np.int64), grammar
        self.prompt_seen = np.unique(prompt)  # [u] ascending: tokens the repetition penalty sees in the prompt
        bias = sorted(penalties.logit_bias.items())
        self._bias_ids = np.array([t for t, _ in bias], dtype=np.int64)  # [b]
        self._bias = np.array([b for _, b in bias], dtype=np.float32)  # [b]
        self.committed = 0  # output tokens made final (the grammar has taken them)
        self.rows = 0  # rows ruled (the target's verify rows read, the drafter's sampled rows)
        self.seconds = 0.0  # spent ruling rows and moving the grammar: the bench's mask cost

    def apply(self, logits: np.ndarray, output: np.ndarray) -> np.ndarray:
        """Logits [V] for the token after ``output`` [m] (every output token so far, drafts
        included) -> ruled logits [V] float32 (a copy)."""
        start = time.perf_counter()
        x = np.array(logits, dtype=np.float32)  # [V]
        p = self.penalties
        if self.grammar is not None:
            x[~self.grammar.allowed(output[self.committed :])] = -np.inf
        if len(output) < p.min_tokens:
            x[self.eos_ids] = -np.inf
        if len(self._bias_ids):
            x[self._bias_ids] += self._bias
        if p.repetition != 1.0:
            seen = np.union1d(self.prompt_seen, output)  # [s]
            v = x[seen]
            x[seen] = np.where(v > 0, v / np.float32(p.repetition), v * np.float32(p.repetition))
        if (p.frequency or p.presence) and len(output):
            ids, counts = np.unique(output, return_counts=True)  # [u]
            x[ids] -= np.float32(p.frequency) * counts.astype(np.float32) + np.float32(p.presence)
        self.rows += 1
        self.seconds += time.perf_counter() - start
        return x

    def allowed(self, output: np.ndarray, proposal: DraftTree) -> DraftTree:
        """``proposal`` without the nodes the grammar forbids after ``output`` (and below them):
        a chain cut at its first forbidden draft; the proposal itself without a grammar."""
        if proposal.is_chain:
            return proposal.prefix(self.valid_drafts(output, proposal.tokens))
        return self.valid_tree(output, proposal)

    def valid_drafts(self, output: np.ndarray, drafts: np.ndarray) -> int:
        """How many of ``drafts`` [k] the grammar lets follow ``output`` (all, without one)."""
        if self.grammar is None:
            return len(drafts)
        start = time.perf_counter()
        self._sync(output)
        valid = self.grammar.valid_prefix(drafts)
        self.seconds += time.perf_counter() - start
        return valid

    def valid_tree(self, output: np.ndarray, tree: DraftTree) -> DraftTree:
        """``tree`` without the nodes the grammar forbids after ``output`` and their path (and
        below them); the tree itself without a grammar."""
        if self.grammar is None:
            return tree
        start = time.perf_counter()
        self._sync(output)
        keep: dict[int, None] = {}  # in node order
        for node in range(tree.size):
            path = tree.path(node)
            if (int(tree.parents[node]) in keep or len(path) == 1) and self.grammar.valid_prefix(tree.tokens[path]) == len(path):
                keep[node] = None
        self.seconds += time.perf_counter() - start
        return tree.subset(list(keep))

    def commit(self, output: np.ndarray) -> None:
        """The sequence's output [m] is now final (the grammar moves past it)."""
        self._sync(output)

    def _sync(self, output: np.ndarray) -> None:
        if len(output) > self.committed:
            if self.grammar is not None:
                start = time.perf_counter()
                self.grammar.commit(output[self.committed :])
                self.seconds += time.perf_counter() - start
            self.committed = len(output)
