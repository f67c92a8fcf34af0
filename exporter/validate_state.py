"""Batched graphs of a model with a recurrent state (linear-attention layers), row by row.

A hybrid model's batched graph reads each row's own recurrent state (past_state.* [B, ...])
beside its K/V, and returns each row's state after every position (present_state.* [B, T, ...]).
The check mirrors ``validate.validate_batched_append``: rows at spread cache lengths with T,
T-1, ... real tokens (the rest padding) and an idle last row, each row fed the state after its
own prefix of the reference text, against the batch-1 graph of its size (itself checked against
transformers) fed that row alone. Every output of a row's real positions (logits, next tokens,
taps, the K/V it appends or writes in place, and its states) must agree to fp32 rounding, else
a one-line error naming the row: a graph that mixes the rows' states fails here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specexport.contract import (
    CACHE_LENGTH,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    VALID_TOKENS,
    is_present,
    present_of,
)
from specexport.errors import SpecexportError
from specexport.exporter.validate import (
    BatchedGraph,
    GraphUnderTest,
    Parity,
    _pairs_agree,
    _restored,
    _token_rows,
    append_rows,
)
from specexport.runtime.engine import EngineOptions, SharedGraphs
from specexport.runtime.ort_engine import OrtEngine
from specexport.runtime.runner import ModelRunner

State = dict[str, np.ndarray]  # past_state name -> [1, ...] one row's state


def states_after(runner: ModelRunner, ref_ids: np.ndarray, lengths: set[int]) -> dict[int, State]:
    """The state after the first ``length`` reference tokens for each of ``lengths``, in one pass
    of the batch-1 runner over the text (its cache refilled from empty, the same tokens' K/V
    rewritten): length -> state."""
    runner.cache.set_length(0)
    states = {}
    for length in sorted(lengths):
        runner.forward(ref_ids[runner.length : length].tolist())
        states[length] = {name: array.copy() for name, array in runner.cache.state_store.rows().items()}
    return states


def validate_batched_state(graphs: list[BatchedGraph], single: dict[int, GraphUnderTest], specs,
                           runner: ModelRunner, ref_ids: np.ndarray, threads: int | None, in_place: bool,
                           tolerance: float = 1e-4, fed: Sequence[int] | None = None) -> dict[str, dict]:
    """Each batched graph of a recurrent model against the batch-1 graph of its size
    (``single``: tokens -> batch-1 graph), row by row (the module docstring). ``runner``: the
    model's batch-1 validation runner, its cache filled with ``ref_ids`` (validate_model's);
    ``in_place``: the graphs write their K/V into the cache (ort-gqa). ``fed``: the row whose
    state each batched row is fed (None: its own; a control that swaps two must fail). Returns
    graph name -> Parity figures (the batch-1 graph as reference), the rows, the worst relative
    difference of the other outputs and the state outputs compared."""
    shared, options = SharedGraphs(), EngineOptions(threads=threads)
    cache = runner.cache
    plans = {graph.name: append_rows(graph.batch, graph.tokens, cache.max_seq_len, ref_ids) for graph in graphs}
    # cache length -> the state after it, for every row of every graph
    states = states_after(runner, ref_ids, {int(row[CACHE_LENGTH][0]) for rows, _ in plans.values() for row in rows})
    results = {}
    for graph in graphs:
        alone = single[graph.tokens]
        engine = OrtEngine(graph.name, graph.path, *specs[graph.name], options, shared)
        one = OrtEngine(alone.name, alone.path, *specs[alone.name], options, shared)
        rows, valid = plans[graph.name]
        lengths = [int(row[CACHE_LENGTH][0]) for row in rows]
        own = [states[length] for length in lengths]
        order = list(range(graph.batch)) if fed is None else list(fed)
        past = {name: np.array(array) for name, array in cache.rows_store.rows().items()}  # [1, n_kv, S_max, hd]
        kv = {name: np.repeat(array, graph.batch, axis=0) for name, array in past.items()}  # [B, n_kv, S_max, hd]
        before = {name: array.copy() for name, array in kv.items()}
        feeds = {**kv,
                 **{name: np.concatenate([own[r][name] for r in order]) for name in own[0]},  # [B, ...]
                 INPUT_IDS: np.concatenate([row[INPUT_IDS] for row in rows]),  # [B, T]
                 CACHE_LENGTH: np.array(lengths, dtype=np.int64)}  # [B]
        takes_valid = VALID_TOKENS in engine.inputs
        if takes_valid:
            feeds[VALID_TOKENS] = np.array(valid, dtype=np.int64)  # [B]
        outputs = [name for name in specs[graph.name][1] if not (in_place and is_present(name))]
        bound = {present_of(name): array for name, array in kv.items()} if in_place else None
        got = engine.run(feeds, outputs, bound)
        parity, worst = Parity(), 0.0
        for r, (row, count, length) in enumerate(zip(rows, valid, lengths)):
            if count == 0:
                continue
            row_feeds = {**cache.rows_store.rows(), **own[r], **row}
            if takes_valid:
                row_feeds[VALID_TOKENS] = np.array([count], dtype=np.int64)  # [1]
            with _restored(cache, length, graph.tokens + 1 if in_place else 0):
                want = one.run(row_feeds, outputs, cache.in_place_outputs() if in_place else None)
                pairs = [(name, _token_rows(name, got[name], r, count), _token_rows(name, want[name], 0, count))
                         for name in outputs]
                span = slice(length, length + count)  # in place: the K/V the row wrote
                pairs += [(name, kv[name][r, :, span], cache.rows_store.rows()[name][0, :, span])
                          for name in (kv if in_place else ())]
            worst = max(worst, _pairs_agree(pairs, tolerance, f"{graph.name}: row {r} ({count} tokens at cache "
                                                              f"length {length})",
                                            "the batch-1 graph run on that row alone with its own state"))
            parity.add(got[LOGITS][r, :count], want[LOGITS][0, :count], got[NEXT_TOKENS][r, :count])
        if in_place and not all(np.array_equal(kv[name][r, :, length + count:], before[name][r, :, length + count:])
                                for name in kv for r, (count, length) in enumerate(zip(valid, lengths))):
            raise SpecexportError(f"{graph.name}: the batched graph wrote cache positions past a row's valid "
                                  "tokens (padding or an idle row); its valid_tokens input is not honoured")
        results[graph.name] = {**parity.to_dict(), "rows": [[length, count] for length, count in zip(lengths, valid)],
                               "max_rel_output_diff": worst, "outputs_compared": sorted(outputs),
                               "own_state_per_row": True}
    cache.set_length(0)
    return results
