"""Build-time parity of a block head's graphs against the independent reference (block_reference.py).

Each graph runs through the runtime's own BlockRunner on real text: the target's hidden states
(transformers' output_hidden_states, which the target's aux_hidden_states output was validated
against) fill the head's cache chunk by chunk with the graph under test itself, so the K/V it
appends are what later blocks read; then blocks are drafted at several cache lengths and
numbers of valid rows, the padding rows holding real features of later positions (the graph
must not see them) and the cache past its length holding stale rows. DSpark's numpy Markov and
confidence heads are checked on the same blocks against the reference's serial refinement.
"""

from __future__ import annotations

import numpy as np

from specexport.contract import (
    BLOCK_HIDDEN,
    CACHE_LENGTH,
    CONTEXT_FEATURES,
    CONTEXT_VALID,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
)
from specexport.errors import SpecexportError
from specexport.exporter.heads.block_reference import reference_block, reference_markov
from specexport.exporter.validate import Parity
from specexport.runtime.block_drafter import BlockHeads, BlockRunner
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine

REFERENCE = "independent torch reference from the published code (exporter/heads/block_reference.py)"


def scenarios(max_seq_len: int, rows: int) -> list[tuple[int, int]]:
    """(cache length, valid rows): an empty and a nearly full cache, all, some and no valid rows."""
    last = max_seq_len - rows - 1  # the anchor must lie inside the reference text
    valid = sorted({rows, max(1, rows // 2), 1, 0})
    return [(length, v) for length in sorted({0, last // 2, last}) for v in valid]


def validate_block_head(head, ctx, names: dict[int, str]) -> None:
    spec = head.spec
    size = ctx.max_seq_len
    ids = ctx.reference_ids(size)  # [S]
    hidden_states = ctx.target_hidden_states(ids)  # L+1 arrays [S, H_t]
    features = np.concatenate([hidden_states[t] for t in ctx.target_taps], axis=-1).astype(np.float32)  # [S, F]
    options = EngineOptions(threads=ctx.threads)
    engines = {rows: OrtEngine(name, ctx.tmp / f"{name}.onnx", *ctx.builder.specs[name], options)
               for rows, name in names.items()}
    cache = KVCache(len(spec.layers), 1, spec.dense.kv_heads, size, spec.dense.head_dim)
    runner = BlockRunner(ctx.name, list(engines.values()), cache, {e.name: rows for rows, e in engines.items()})
    heads = BlockHeads(spec.head_arrays | ({"d2t": spec.d2t} if spec.d2t is not None else {}),
                       spec.params.get("markov"), bool(spec.params.get("confidence_with_markov")))
    ckpt = spec.ckpt
    references: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # anchor position -> reference logits, hidden

    def reference(start: int) -> tuple[np.ndarray, np.ndarray]:
        if start not in references:
            references[start] = reference_block(spec.layout, ckpt.config, ckpt.tensors, head.target.model,
                                                hidden_states, ids, start)
        return references[start]

    for rows, engine in engines.items():
        with ctx.step("validate", f"{names[rows]}") as s:
            cache.rewind(0)
            for at in range(0, size - 1, rows):  # the graph under test fills the cache itself
                runner.run(rows, 0, features[at : min(at + rows, size - 1)])
            parity = Parity()
            for length, valid in scenarios(size, rows):
                cache.length = length  # slots past the length keep stale rows (read-only runs)
                start = length + valid
                feeds = dict(cache.view())
                feeds[INPUT_IDS] = np.array([[ids[start]]], dtype=np.int64)  # [1, 1]
                feeds[CONTEXT_FEATURES] = features[None, length : length + rows].copy()  # [1, C, F] padding: real rows
                feeds[CONTEXT_VALID] = np.array([valid], dtype=np.int64)
                feeds[CACHE_LENGTH] = np.array([length], dtype=np.int64)
                wanted = [LOGITS, NEXT_TOKENS] + ([BLOCK_HIDDEN] if BLOCK_HIDDEN in engine.outputs else [])
                out = engine.run(feeds, wanted)
                want_logits, want_hidden = reference(start)
                got = out[LOGITS][0]  # [n, V_d]
                if got.shape != want_logits.shape:
                    raise SpecexportError(f"validation failed for {names[rows]} (against {REFERENCE}): the graph drafts "
                                          f"{list(got.shape)} logits, the reference {list(want_logits.shape)}")
                parity.add(got, want_logits)
                if not np.array_equal(out[NEXT_TOKENS][0], _mapped(spec.d2t, got.argmax(-1))):
                    parity.next_tokens_match = False
                if heads.serial:
                    _check_heads(parity, heads, spec, got, out[BLOCK_HIDDEN][0], want_logits, want_hidden, int(ids[start]))
            figures = parity.to_dict()
            ctx.record_parity(names[rows], figures, reference=REFERENCE)
            s.detail = (f"max |Δlogit| {figures['max_abs_logit_diff']:.2e}, "
                        f"argmax agreement {figures['argmax_agreement']:.1%} over {figures['positions']} drafts")
    cache.rewind(0)
    ctx.time_with(runner)


def _mapped(d2t: np.ndarray | None, draft_ids: np.ndarray) -> np.ndarray:
    return draft_ids if d2t is None else d2t[draft_ids]


def _check_heads(parity: Parity, heads: BlockHeads, spec, got: np.ndarray, hidden: np.ndarray,
                 want_logits: np.ndarray, want_hidden: np.ndarray, anchor: int) -> None:
    """The runtime's serial refinement on the graph's outputs against the reference's on its own."""
    want, want_tokens, want_conf = reference_markov(spec.ckpt.config, spec.ckpt.tensors, want_logits, want_hidden,
                                                    anchor, spec.d2t)
    heads.start()
    prev = anchor
    rows, confidences = [], []
    for k in range(len(got)):
        logits, confidence = heads.step(got[k], hidden[k], prev)
        rows.append(logits)
        confidences.append(confidence)
        prev = int(want_tokens[k])  # teacher-forced on the reference's path, so one miss does not cascade
    parity.add(np.stack(rows), want)
    if want_conf is not None:
        # a probability in [0, 1]: its error counts against the logit limit like a logit's
        parity.max_abs_logit_diff = max(parity.max_abs_logit_diff,
                                        float(np.abs(np.array(confidences) - want_conf).max()))
