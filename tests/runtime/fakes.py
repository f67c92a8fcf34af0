"""Engine-free stand-ins for the decode loop: a first-order Markov "model".

``MarkovRunner`` has the ModelRunner surface the loop uses (forward, rewind, cache, seconds).
Its next-token logits depend only on the current token, so the exact distribution of any
generated sequence is a product of table rows: what the statistical tests compare against.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from specexport.runtime.runner import StepOutput


class MarkovRunner:
    def __init__(self, table: np.ndarray, max_seq_len: int = 256):
        self.table = np.asarray(table, dtype=np.float32)  # [V, V] logits of next | current
        self.cache = SimpleNamespace(max_seq_len=max_seq_len, length=0)
        self.seconds = 0.0
        self.calls = 0
        self.fed: list[int] = []  # tokens whose "KV" is in the cache

    @property
    def length(self) -> int:
        return self.cache.length

    def rewind(self, length: int) -> None:
        assert 0 <= length <= self.cache.length
        del self.fed[length:]
        self.cache.length = length

    def forward(self, tokens, want_logits: bool = False, inputs=None, want=()) -> StepOutput:
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


class OracleDrafter:
    """Proposes exactly the target's greedy continuation: every draft is accepted."""

    name = "oracle"
    engine_seconds = 0.0  # no engines: all its time is host work

    def __init__(self, table: np.ndarray):
        self.table = table

    needs: tuple[str, ...] = ()

    def reset(self, prompt, target_out=None) -> None:
        pass

    def propose(self, context, k, sampling, rng):
        from specexport.runtime.acceptance import Draft

        tokens, last = [], int(context[-1])
        for _ in range(k):
            last = int(self.table[last].argmax())
            tokens.append(last)
        return Draft(np.array(tokens, dtype=np.int64))

    def accept(self, n, token, target_out=None) -> None:
        pass


class FixedDrafter:
    """Proposes the same tokens every round (tests of what the loop does with them)."""

    name = "fixed"
    engine_seconds = 0.0  # no engines: all its time is host work

    def __init__(self, tokens):
        self.tokens = np.array(tokens, dtype=np.int64)

    needs: tuple[str, ...] = ()

    def reset(self, prompt, target_out=None) -> None:
        pass

    def propose(self, context, k, sampling, rng):
        from specexport.runtime.acceptance import Draft

        return Draft(self.tokens[:k])

    def accept(self, n, token, target_out=None) -> None:
        pass
