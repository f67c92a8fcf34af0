"""The batched decode loop: many sequences, one verify pass per round for all of them.

Each running sequence owns a slot, a row of the target's [B_max, n_kv, S_max, hd] cache, and
its own state: committed tokens, position, drafter, sampling, stops and stats. A round drafts
for every running sequence, feeds all of them through the target's batched graph (each row
right-padded to the longest; VALID_TOKENS gives its real count and CACHE_LENGTH its position,
so padding is neither attended to nor written), then accepts and commits per row exactly as the
single-sequence loop (runtime/decode.py) does. Sequences join free slots between rounds (each
prefilled alone, at batch 1, into its own row) and leave when done; the running rows are kept at
the front of the cache, so a round runs the smallest built batch size that holds them.

Drafters: those without per-sequence engine state (none, ngram). Drafters with their own
caches (draft models, the int4 copy, hidden-state heads) need batched drafter graphs: not yet.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specexport.contract import (
    BATCHED_ROLES,
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    DraftSchedule,
    KVUpdate,
    Manifest,
    past_names,
    present_of,
)
from specexport.errors import BadInput
from specexport.runtime.acceptance import EMPTY_DRAFT, Draft, Sampling, Warped, greedy, rejection
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.decode import DecodeStats
from specexport.runtime.drafters import Drafter
from specexport.runtime.engine import Engine, EngineOptions, LazyEngine, SharedGraphs
from specexport.runtime.goodput import best_width, observed
from specexport.runtime.kv_cache import CacheLength
from specexport.runtime.runner import PAD_ID, ModelRunner

STATELESS_DRAFTERS = ("none", "ngram")  # drafter kinds the batched loop runs (no engine state per sequence)


@dataclass
class Request:
    prompt: np.ndarray  # [n] int64, n >= 1
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    stop: Callable[[int], bool] | None = None  # sees each token; True ends the sequence after it


@dataclass
class Finished:
    tokens: list[int]
    stats: DecodeStats


@dataclass
class _Running:
    index: int  # the request's position in the submitted list
    request: Request
    context: np.ndarray  # [S_max + 1] committed tokens: prompt + output
    length: int  # committed tokens; the cache holds length - 1 of them
    stats: DecodeStats


class SlotCache(CacheLength):
    """One slot (row) of the batch cache, seen as a batch-1 cache: the prefill runner of that
    slot writes into the row in place."""

    def __init__(self, tensors: dict[str, np.ndarray], slot: int, num_layers: int, max_seq_len: int):
        super().__init__(num_layers, max_seq_len)
        self._view = {name: array[slot : slot + 1] for name, array in tensors.items()}  # [1, n_kv, S_max, hd] views
        self._present = {present_of(name): array for name, array in self._view.items()}

    def view(self) -> dict[str, np.ndarray]:
        return self._view

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        return self._present

    def write(self, presents, count: int) -> None:
        raise ValueError("a slot of the batch cache is written in place only (ort-gqa graphs)")


class _BatchedCall:
    """One batched engine (B rows, T tokens) with its feed buffers over the first B slots."""

    def __init__(self, engine: Engine, batch: int, tokens: int, cache: dict[str, np.ndarray]):
        self.engine, self.batch, self.tokens = engine, batch, tokens
        self.feeds = {name: array[:batch] for name, array in cache.items()}  # [B, n_kv, S_max, hd] views
        self.ids = self.feeds[INPUT_IDS] = np.full((batch, tokens), PAD_ID, dtype=np.int64)  # [B, T]
        self.lengths = self.feeds[CACHE_LENGTH] = np.zeros(batch, dtype=np.int64)  # [B]
        self.valid = self.feeds[VALID_TOKENS] = np.zeros(batch, dtype=np.int64)  # [B]
        self.bound = {present_of(name): array[:batch] for name, array in cache.items()}

    def run(self, rows: list[tuple[int, np.ndarray]], want_logits: bool) -> dict[str, np.ndarray]:
        """rows: (cache length, tokens [1+k]) per running slot; the rest of the B rows idle."""
        self.ids.fill(PAD_ID)
        self.lengths.fill(0)
        self.valid.fill(0)
        for r, (length, tokens) in enumerate(rows):
            self.ids[r, : len(tokens)] = tokens
            self.lengths[r] = length
            self.valid[r] = len(tokens)
        outputs = [NEXT_TOKENS, LOGITS] if want_logits else [NEXT_TOKENS]
        return self.engine.run(self.feeds, outputs, self.bound)  # next_tokens [B, T], logits [B, T, V]


class BatchedTarget:
    """The target's batched engines over one [B_max] cache, and a batch-1 prefill runner per slot."""

    def __init__(self, manifest: Manifest, backend: str, options: EngineOptions, shared: SharedGraphs,
                 max_batch: int | None = None, cost_ms: Callable | None = None):
        info = manifest.models["target"]
        if info.attention != "ort-gqa" or backend != "onnxruntime":
            raise BadInput(f"{manifest.root}: batched decoding needs onnxruntime engines built with attention: ort-gqa")
        built = manifest.batch_sizes("target")
        self.batches = [b for b in built if max_batch is None or b <= max_batch] or [1]
        self.slots = max(self.batches)
        self.max_seq_len = info.max_seq_len
        shape = info.kv.shape(self.slots)  # [B_max, n_kv, S_max, hd]
        self.cache = {name: np.zeros(shape, dtype=info.kv_dtype) for name in past_names(info.num_layers)}
        self.calls: dict[tuple[int, int], _BatchedCall] = {}  # (B, T) -> the call
        for batch in self.batches:
            for entry in manifest.engines_of("target", backend, batch=batch):
                if entry.role in BATCHED_ROLES and entry.kv_update == KVUpdate.IN_PLACE:
                    engine = LazyEngine(entry, manifest.root, options, None, shared)
                    self.calls[(batch, entry.tokens)] = _BatchedCall(engine, batch, entry.tokens, self.cache)
        singles = [e for e in manifest.engines_of("target", backend) if e.role.decoding]
        self.prefill = [ModelRunner(f"target[{slot}]", [LazyEngine(e, manifest.root, options, None, shared) for e in singles],
                                    SlotCache(self.cache, slot, info.num_layers, info.max_seq_len),
                                    {e.name: e.tokens for e in singles},
                                    {e.tokens: cost_ms(e) for e in singles} if cost_ms else None,
                                    frozenset(e.name for e in singles), roles={e.name: e.role for e in singles})
                        for slot in range(self.slots)]
        self.seconds = 0.0  # inside batched engines
        self.costs: dict[tuple[int, int], float] = {}  # (B, T) -> seconds, from measure_costs

    def call_for(self, rows: int, tokens: int) -> _BatchedCall:
        """The smallest built batch holding ``rows``, and its smallest graph holding ``tokens``
        (or its largest, when none does: the caller trims the drafts)."""
        batch = min(b for b in self.batches if b >= rows)
        sizes = sorted(t for b, t in self.calls if b == batch)
        fitting = [t for t in sizes if t >= tokens]
        return self.calls[(batch, fitting[0] if fitting else sizes[-1])]

    def widths(self, rows: int) -> list[int]:
        """The verify widths T built at the batch size that holds ``rows``."""
        batch = min(b for b in self.batches if b >= rows)
        return sorted(t for b, t in self.calls if b == batch)

    def measure_costs(self, rounds: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of every batched call (B, T), all rows full, taken in turn round after
        round. Writes into every slot: only before any sequence runs."""
        times: dict[tuple[int, int], list[float]] = {key: [] for key in self.calls}
        middle = self.max_seq_len // 2
        for round_ in range(rounds + 1):
            for (batch, tokens), call in self.calls.items():
                rows = [(middle, np.full(tokens, PAD_ID, dtype=np.int64))] * batch
                start = time.perf_counter()
                call.run(rows, want_logits=False)
                if round_:  # round 0 opens the sessions and warms up
                    times[(batch, tokens)].append(time.perf_counter() - start)
        self.costs = {key: float(np.median(v)) for key, v in times.items()}
        return self.costs

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` cache positions into slot ``dst``."""
        for array in self.cache.values():
            array[dst, :, :length] = array[src, :, :length]


def decode_batch(target: BatchedTarget, drafter: Drafter, requests: Sequence[Request], *, draft_len: int,
                 eos_ids: frozenset[int], on_token: Callable[[int, int], None] | None = None,
                 schedule: DraftSchedule | None = None, per_sequence: bool = False) -> list[Finished]:
    """Decode every request, up to ``target.slots`` at a time, each exactly as it would decode
    alone (greedy: the same tokens; sampled: the same distribution). ``on_token(index, token)``
    sees each emitted token. ``schedule``: each round drafts at most its depth for the number of
    running sequences (and ``draft_len``). ``per_sequence``: each round's verify width from the
    rows' own acceptance and the measured batch costs (runtime/goodput.py; the schedule then
    does not apply)."""
    if per_sequence and not target.costs:
        target.measure_costs()
    widths = _Widths(DepthPolicy(lambda tokens: None)) if per_sequence else None
    waiting = deque(enumerate(requests))
    running: list[_Running] = []
    finished: dict[int, Finished] = {}
    while waiting or running:
        while waiting and len(running) < target.slots:  # join: prefill alone, into the next slot
            index, request = waiting.popleft()
            running.append(_start(target, len(running), index, request, draft_len))
        depth = draft_len if schedule is None or per_sequence else min(draft_len, schedule.depth(len(running)))
        _round(target, drafter, running, depth, eos_ids, on_token, widths)
        slot = 0
        while slot < len(running):  # leave: the last running row moves into the freed slot
            seq = running[slot]
            if not seq.stats.stop_reason:
                slot += 1
                continue
            finished[seq.index] = Finished(seq.context[len(seq.request.prompt) : seq.length].tolist(), seq.stats)
            last = running.pop()
            if last is not seq:
                target.move(len(running), slot, last.length - 1)
                running[slot] = last
    return [finished[i] for i in range(len(requests))]


def _start(target: BatchedTarget, slot: int, index: int, request: Request, draft_len: int) -> _Running:
    prompt = np.asarray(request.prompt, dtype=np.int64)
    context = np.zeros(target.max_seq_len + 1, dtype=np.int64)
    context[: len(prompt)] = prompt
    stats = DecodeStats(draft_len=draft_len)
    start = time.perf_counter()
    runner = target.prefill[slot]
    runner.rewind(0)
    runner.forward(prompt[:-1])  # the last prompt token opens round one
    stats.prefill_s = time.perf_counter() - start
    return _Running(index, request, context, len(prompt), stats)


@dataclass
class _Widths:
    """Per-sequence depth's state over one batched decode: the acceptance of each draft tag
    (the n-gram match length, say), pooled over all rows with DepthPolicy's prior and
    forgetting, and the rounds since drafts were last verified (a probe every
    ``policy.probe_every`` rounds that chose no drafts, so an estimate can recover)."""

    policy: DepthPolicy
    skipped: int = 0

    def choose(self, target: BatchedTarget, drafts: list[Draft], rows: int, width: int, default_tag: str) -> int:
        batch = min(b for b in target.batches if b >= rows)
        built = target.widths(rows)
        holding = [w for w in built if w >= width][:1] or built[-1:]  # the narrowest holding every draft
        rates = [self.policy.alpha(d.tag or default_tag) for d in drafts]
        chosen = best_width([w for w in built if w < width] + holding, lambda w: target.costs[(batch, w)],
                            rates, [d.size for d in drafts])
        self.skipped = self.skipped + 1 if chosen == 1 else 0
        if self.skipped >= self.policy.probe_every:
            self.skipped, chosen = 0, holding[0]
        return chosen


def _round(target: BatchedTarget, drafter: Drafter, running: list[_Running], draft_len: int,
           eos_ids: frozenset[int], on_token: Callable[[int, int], None] | None, widths: _Widths | None = None) -> None:
    """One draft -> verify -> accept -> commit round over every running sequence."""
    start = time.perf_counter()
    drafts: list[Draft] = []
    for seq in running:
        k = min(draft_len, target.max_seq_len - seq.length, seq.request.max_new_tokens - seq.stats.tokens - 1)
        t0 = time.perf_counter()
        draft = drafter.propose(seq.context[: seq.length], k, seq.request.sampling, seq.request.rng) if k > 0 else EMPTY_DRAFT
        seq.stats.draft_s += time.perf_counter() - t0
        drafts.append(draft)
    # rows are padded to the longest; an in-place graph checks the padded length against the cache
    room = min(target.max_seq_len - (seq.length - 1) for seq in running)
    width = min(1 + max(d.size for d in drafts), room)
    if widths is not None and width > 1:  # the width with the most expected tokens per second of verify
        width = widths.choose(target, drafts, len(running), width, drafter.name)
    call = target.call_for(len(running), width)
    drafts = [d if 1 + d.size <= call.tokens else d.trimmed(call.tokens - 1) for d in drafts]
    sampled = any(not seq.request.sampling.greedy for seq in running)
    rows = [(seq.length - 1, np.concatenate((seq.context[seq.length - 1 : seq.length], d.tokens)))
            for seq, d in zip(running, drafts)]
    t0 = time.perf_counter()
    out = call.run(rows, sampled)
    verify_s = time.perf_counter() - t0
    target.seconds += verify_s
    if widths is not None:
        key = (call.batch, call.tokens)
        target.costs[key] = observed(target.costs.get(key), verify_s)
    for r, (seq, draft) in enumerate(zip(running, drafts)):
        valid = 1 + draft.size
        if seq.request.sampling.greedy:
            n_accepted, next_token = greedy(draft.tokens, out[NEXT_TOKENS][r, :valid])
        else:
            n_accepted, next_token = rejection(draft, Warped(out[LOGITS][r, :valid], seq.request.sampling),
                                               seq.request.rng)
        drafter.accept(n_accepted, next_token, {})
        if widths is not None:
            widths.policy.update(draft.tag or drafter.name, draft.size, n_accepted)
        _commit(seq, draft, n_accepted, next_token, eos_ids, on_token)
        seq.stats.verify_s += verify_s
        seq.stats.total_s += time.perf_counter() - start


def _commit(seq: _Running, draft: Draft, n_accepted: int, next_token: int, eos_ids: frozenset[int],
            on_token: Callable[[int, int], None] | None) -> None:
    """The round's tokens, cut where the sequence stops (as runtime/decode.py does)."""
    stats, request = seq.stats, seq.request
    emitted = 0
    for token in (*draft.tokens[:n_accepted].tolist(), next_token):
        seq.context[seq.length] = token
        seq.length += 1
        emitted += 1
        stopped = request.stop is not None and request.stop(token)
        stats.stop_reason = ("eos" if token in eos_ids else "stop_string" if stopped
                             else "max_new_tokens" if stats.tokens + emitted >= request.max_new_tokens
                             else "kv_full" if seq.length >= len(seq.context) else "")
        if on_token is not None:
            on_token(seq.index, token)
        if stats.stop_reason:
            break
    stats.count_round(draft.size, n_accepted, emitted)
