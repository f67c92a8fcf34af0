"""ModelRunner: one neural model's engines (one per token count) over its own KV cache.

``forward(tokens)`` feeds tokens at the cache's current length through engines (padding a
short piece), appends their K/V to the cache and returns the model's outputs for each real
token. Which engines: the sequence of pieces that costs least by the build's measured costs
(a long prompt: prefill chunks; a verify: the one engine that holds it), or without costs the
smallest engine that holds the input. Feed buffers are allocated once per engine and updated
in place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specexport.runtime.engine import Engine
from specexport.runtime.kv_cache import KVCache

PAD_ID = 0  # any id works: padded positions are never read back


@dataclass
class StepOutput:
    next_tokens: np.ndarray  # [n] int64, the argmax at each position
    logits: np.ndarray | None  # [n, V] float32, when asked for


class ModelRunner:
    def __init__(self, name: str, engines: Sequence[Engine], cache: KVCache, tokens_of: dict[str, int],
                 cost_ms: dict[int, float] | None = None, in_place: frozenset[str] = frozenset()):
        self.name = name
        self.cache = cache
        # token count -> engine, smallest first
        self._engines = sorted(((tokens_of[e.name], e) for e in engines), key=lambda pair: pair[0])
        if not self._engines:
            raise ValueError(f"model {name} has no engines")
        self._by_size = dict(self._engines)
        self._first_piece = self._plan_pieces(cost_ms or {}, cache.max_seq_len)
        self._feeds: dict[int, dict[str, np.ndarray]] = {}
        for tokens, _ in self._engines:
            feeds = dict(cache.view())
            feeds["input_ids"] = np.full((1, tokens), PAD_ID, dtype=np.int64)  # [B, T]
            feeds["cache_length"] = np.zeros(1, dtype=np.int64)  # [B]
            self._feeds[tokens] = feeds
        presents = [f"present.{i}.{kind}" for i in range(cache.num_layers) for kind in ("key", "value")]
        # engines that update the cache in place (attention: ort-gqa) get it bound as their
        # present outputs and return only tokens (and logits); the others return the new K/V
        self._in_place = in_place
        self._cache_outputs = cache.in_place_outputs()
        self._outputs = {  # (in place?, want logits?) -> outputs to ask for
            (False, False): ["next_tokens", *presents],
            (False, True): ["next_tokens", "logits", *presents],
            (True, False): ["next_tokens"],
            (True, True): ["next_tokens", "logits"],
        }
        self.seconds = 0.0  # time inside engines, for the stats
        self.calls = 0

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def sizes(self) -> list[int]:
        return [t for t, _ in self._engines]

    def engine_size(self, tokens: int) -> int:
        """Token count of the engine that runs ``tokens`` tokens in one call (or the largest)."""
        return self._pick(tokens)[0]

    def time_engines(self, sizes: Sequence[int], rounds: int) -> dict[int, float]:
        """Median seconds of one run of each engine, the sizes taken in turn round after round
        (so a drift of the machine hits them all alike), over a half-full cache. The cache is
        read, not written, except by in-place engines, after which it is rewound to empty."""
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for round_ in range(rounds + 1):  # round 0 warms up
            for size in sizes:
                self._feeds[size]["cache_length"][0] = (self.cache.max_seq_len - size) // 2
                start = time.perf_counter()
                self._run(size, want_logits=False)
                if round_:
                    times[size].append(time.perf_counter() - start)
        if any(self._by_size[size].name in self._in_place for size in sizes):
            self.cache.rewind(0)
        return {size: float(np.median(values)) for size, values in times.items()}

    def time_engine(self, size: int, repeats: int) -> float:
        return self.time_engines([size], repeats)[size]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)

    def _plan_pieces(self, cost_ms: dict[int, float], longest: int) -> list[int] | None:
        """For every input length, the engine size to run first so that the whole input
        costs least, over the engines with a measured cost (from the build). None: no costs,
        use the fit rule."""
        sizes = [t for t, _ in self._engines if cost_ms.get(t)]
        if not sizes:
            return None
        total = [0.0] * (longest + 1)  # total[r]: cheapest cost of r tokens
        first = [sizes[0]] * (longest + 1)
        for r in range(1, longest + 1):
            total[r], first[r] = min((cost_ms[t] + total[max(r - t, 0)], -t) for t in sizes)
            first[r] = -first[r]
        return first

    def _pick(self, remaining: int) -> tuple[int, Engine]:
        if self._first_piece is not None:
            size = self._first_piece[min(remaining, len(self._first_piece) - 1)]
            choice = size, self._by_size[size]
        else:
            choice = next(((t, e) for t, e in self._engines if t >= remaining), self._engines[-1])
        if choice[1].name in self._in_place and choice[0] > self.cache.free:
            # an in-place graph writes all its positions, padding too: take one that fits
            choice = max(((t, e) for t, e in self._engines if t <= self.cache.free), key=lambda te: te[0])
        return choice

    def _run(self, size: int, want_logits: bool) -> dict[str, np.ndarray]:
        """One run of the engine of ``size`` tokens on its feeds; returns its outputs."""
        engine = self._by_size[size]
        in_place = engine.name in self._in_place
        outputs = self._outputs[(in_place, want_logits)]
        if in_place:
            return engine.run(self._feeds[size], outputs, self._cache_outputs)
        return engine.run(self._feeds[size], outputs)

    def forward(self, tokens: Sequence[int], want_logits: bool = False) -> StepOutput:
        n = len(tokens)
        if n > self.cache.free:
            raise ValueError(f"{self.name}: {n} tokens do not fit in the {self.cache.free} free cache slots")
        next_parts, logit_parts = [], []
        done = 0
        while done < n:
            size, engine = self._pick(n - done)
            count = min(size, n - done)
            feeds = self._feeds[size]
            ids = feeds["input_ids"]
            ids[0, :count] = tokens[done : done + count]
            ids[0, count:] = PAD_ID
            feeds["cache_length"][0] = self.cache.length
            start = time.perf_counter()
            result = self._run(size, want_logits)
            self.seconds += time.perf_counter() - start
            if engine.name in self._in_place:
                self.cache.advance(count)  # the engine wrote its positions into the cache
            else:
                self.cache.write(result, count)
            self.calls += 1
            next_parts.append(result["next_tokens"][0, :count])
            if want_logits:
                logit_parts.append(result["logits"][0, :count])
            done += count
        next_tokens = next_parts[0] if len(next_parts) == 1 else np.concatenate(next_parts)
        logits = None
        if want_logits:
            logits = logit_parts[0] if len(logit_parts) == 1 else np.concatenate(logit_parts)
        return StepOutput(next_tokens, logits)

