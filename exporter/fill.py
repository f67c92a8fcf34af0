"""Fill graphs (contract.Role.FILL): a drafter's graph with only the outputs its cache keeps.

A drafter feeds rows whose outputs nobody reads: its prompt, and rows fed ahead of a catch-up
call. onnxruntime runs every node of a graph whatever outputs a call asks for, so those rows
paid for logits over the whole vocabulary (SmolLM2's EAGLE-3 head: 9.1 ms for a 64-row call,
2.9 ms without). The fill graph is a copy with every other output dropped and the nodes that
computed them pruned, over the same weights file; its entries are the model's batch-1 sizes.
Built for ort-gqa recipes (one symbolic graph per model, so the copy is one more file and one
more session), not for static standard graphs nor TensorRT.

``check_fill`` is the build's proof that a fill call leaves the cache exactly as the full
graph's call does, at a few cache lengths and every fill size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from specexport.contract import Role, is_cache_output
from specexport.errors import SpecexportError
from specexport.exporter.onnx_export import drop_outputs
from specexport.runtime.runner import ModelRunner

# the decoding roles whose batch-1 sizes a fill graph gets an entry at (the pieces a fill plans over)
FILLED_ROLES = frozenset({Role.DECODE, Role.CATCHUP, Role.PREFILL})


def fill_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` whose outputs are its cache outputs alone, the nodes and weights
    nothing reads any more removed."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    drop_outputs(copy, {v.name for v in copy.graph.output if not is_cache_output(v.name)})
    used = {name for node in copy.graph.node for name in node.input}
    kept = [tensor for tensor in copy.graph.initializer if tensor.name in used]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    return copy


def fill_sizes(sizes: Mapping[int, Role]) -> list[int]:
    """The token counts a model's fill graph gets entries at: its batch-1 decoding sizes (token
    count -> role), so that a fill call can run the pieces its full graph would."""
    return sorted(t for t, role in sizes.items() if role in FILLED_ROLES)


def check_fill(runner: ModelRunner, ids: np.ndarray, inputs: Mapping[str, np.ndarray] | None = None,
               lengths: Sequence[int] = ()) -> dict:
    """For each fill size T and cache length L: ``runner.forward`` T tokens of ``ids`` at L and
    ``runner.fill`` them at L from the same cache must leave every cache array equal bit for bit.
    ``inputs``: extra per-token rows (a chain head's features), name -> [S, F] over ``ids``.
    SpecexportError naming the size and length otherwise; returns the figures recorded."""
    cache = runner.cache
    arrays = cache.view()  # past name -> [1, n_kv, S_max, hd], the cache itself
    tested = []
    for size in runner.fill_sizes:
        for length in lengths:
            if length + size > min(len(ids), cache.max_seq_len):
                continue
            rows = slice(length, length + size)
            extra = {name: values[rows] for name, values in (inputs or {}).items()}
            before = {name: array.copy() for name, array in arrays.items()}
            cache.length = length  # every slot below it was written by earlier calls
            runner.forward(ids[rows].tolist(), inputs=extra)
            full = {name: array.copy() for name, array in arrays.items()}
            for name, array in arrays.items():
                array[...] = before[name]
            cache.length = length
            runner.fill(ids[rows].tolist(), inputs=extra)
            differ = [name for name, array in arrays.items() if not np.array_equal(array, full[name])]
            if differ or cache.length != length + size:
                raise SpecexportError(f"validation failed for {runner.engine_at(size, fill=True)}: at cache length "
                                      f"{length} its cache differs from the full graph's ({(differ or ['length'])[0]})")
            tested.append([size, length])
    return {"cache_equal_to_full_graph": True, "tested": tested}
