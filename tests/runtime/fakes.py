"""Engine-free stand-ins for the decode loop: a first-order Markov "model".

``MarkovRunner`` has the ModelRunner surface a Model uses (forward, cache, seconds); ``markov``
makes the one-slot Model over it that the loop runs. Its next-token logits depend only on the
current token, so the exact distribution of any generated sequence is a product of table rows:
what the statistical tests compare against. ``decode`` runs one request through the loop.
"""

from __future__ import annotations

import numpy as np

from specexport.runtime.acceptance import Draft, Sampling
from specexport.runtime.drafters import Stateless
from specexport.runtime.loop import BatchLoop, Request
from specexport.runtime.model import Model, SlotCaches
from specexport.runtime.runner import StepOutput
from specexport.runtime.stats import DecodeStats


class _Length:
    """The cache's bookkeeping: a length that only ever moves back (a rewind) or by what is fed."""

    def __init__(self, runner: MarkovRunner, max_seq_len: int):
        self.runner, self.max_seq_len, self.length = runner, max_seq_len, 0

    def set_length(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot rewind a cache of length {self.length} to {length}"
        del self.runner.fed[length:]
        self.length = length


class MarkovRunner:
    def __init__(self, table: np.ndarray, max_seq_len: int = 256):
        self.table = np.asarray(table, dtype=np.float32)  # [V, V] logits of next | current
        self.cache = _Length(self, max_seq_len)
        self.seconds = 0.0
        self.calls = 0
        self.fed: list[int] = []  # tokens whose "KV" is in the cache
        self.decoding_sizes = [1]

    @property
    def length(self) -> int:
        return self.cache.length

    def engine_size(self, tokens: int) -> int:
        return tokens

    def verify_size(self, tokens: int) -> int:
        return tokens

    @property
    def long_sizes(self) -> list[int]:
        return []

    def fill(self, tokens, inputs=None) -> None:
        """As ModelRunner.fill over a model without fill entries: ``forward``, nothing read."""
        self.forward(tokens, inputs=inputs)

    def forward(self, tokens, want_logits: bool = False, inputs=None, want=(), verify: bool = False) -> StepOutput:
        """As ModelRunner.forward: a ValueError past the cache; no input runs nothing (no call
        counted) and returns empty outputs of the usual dtypes."""
        tokens = [int(t) for t in tokens]
        if self.cache.length + len(tokens) > self.cache.max_seq_len:
            raise ValueError(f"markov: {len(tokens)} tokens do not fit in the cache")
        self.fed += tokens
        self.cache.length += len(tokens)
        self.calls += bool(tokens)
        logits = self.table[np.asarray(tokens, dtype=np.int64)]  # [n, V]
        next_tokens = logits.argmax(-1).astype(np.int64)  # [n]
        return StepOutput(next_tokens, logits.copy() if want_logits else None)


def random_table(vocab: int, seed: int, spread: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, spread, size=(vocab, vocab)).astype(np.float32)


def markov(table: np.ndarray, max_seq_len: int = 256, runner_class: type = MarkovRunner) -> Model:
    """A one-slot Model over a MarkovRunner (its runner: ``model.runners[0]``)."""
    runner = runner_class(table, max_seq_len)
    return Model("markov", [runner], {}, SlotCaches([runner.cache], None), max_seq_len)  # type: ignore[list-item]


def decode(target: Model, drafter, prompt, *, draft_len: int, max_new_tokens: int, sampling: Sampling,
           eos_ids=frozenset(), rng=None, stop=None, policy=None) -> tuple[list[int], DecodeStats]:
    """One request through the decode loop (a batch of one): its tokens and stats."""
    out: list[int] = []
    loop = BatchLoop(target, drafter, draft_len=draft_len, eos_ids=frozenset(eos_ids),
                     on_token=lambda key, token: out.append(token),
                     adaptive=None if policy is None else (lambda: policy))
    loop.submit(0, Request(np.asarray(prompt, dtype=np.int64), max_new_tokens, sampling,
                           rng if rng is not None else np.random.default_rng(0), stop))
    finished = []
    for ended in loop.run():
        finished += ended
    return out, finished[0][1].stats


class OracleDrafter(Stateless):
    """Proposes exactly the target's greedy continuation: every draft is accepted."""

    name = "oracle"

    def __init__(self, table: np.ndarray):
        self.table = table

    def chain(self, context, k):
        tokens, last = [], int(context[-1])
        for _ in range(k):
            last = int(self.table[last].argmax())
            tokens.append(last)
        return Draft(np.array(tokens, dtype=np.int64))


class FixedDrafter(Stateless):
    """Proposes the same tokens every round (tests of what the loop does with them)."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens = np.array(tokens, dtype=np.int64)

    def chain(self, context, k):
        return Draft(self.tokens[:k])


def spy_proposals(drafter, seen: list) -> None:
    """Record each proposal of a one-slot drafter, in place: (the committed context, the drafts,
    the depth asked for), for the rounds that asked for drafts."""
    propose = drafter.propose

    def recorded(rows, budget):
        drafts = propose(rows, budget)
        ks = budget.depths
        if ks and ks[0] > 0:
            seen.append((np.array(rows[0].context), np.array(drafts[0].tokens), int(ks[0])))
        return drafts

    drafter.propose = recorded


def decode_all(target, drafter, requests, **loop_options) -> list:
    """Every request through one BatchLoop (runtime/loop.py), up to ``target.slots`` at a time:
    their ``Finished`` results in order. ``loop_options``: BatchLoop's keywords (draft_len and
    eos_ids at least)."""
    from specexport.runtime.loop import BatchLoop

    loop = BatchLoop(target, drafter, **loop_options)
    for index, request in enumerate(requests):
        loop.submit(index, request)
    finished = {}
    for ended in loop.run():
        finished.update(ended)
    return [finished[i] for i in range(len(requests))]
