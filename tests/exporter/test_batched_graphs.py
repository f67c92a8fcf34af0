"""Batched engines (issue 11, part 1): `shapes.batch: [1, 2, 4]` builds decode, catch-up and
verify entries at every batch size over the model's one graph (batch and token count symbolic,
so every size shares the weights), each row with its own cache length and its own count of
valid tokens; the build checks every batched graph row by row against the batch-1 graph, with
ragged rows and an idle row."""

from __future__ import annotations

import numpy as np

from specexport.contract import BATCHED_ROLES, CACHE_LENGTH, INPUT_IDS, VALID_TOKENS, Role, read_manifest
from specexport.exporter.validate import row_plan
from specexport.runtime import load
from specexport.runtime.engine import EngineOptions, SharedGraphs
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine
from tests.conftest import TINY_SHAPE, run_cli, tiny_recipe

BATCHES = (1, 2, 4)



def test_every_decoding_role_is_built_at_every_batch_size_over_one_graph_file(batched_engines):
    manifest = read_manifest(batched_engines)
    for model in ("target", "quantized-self", "draft-model"):
        fills = [e for e in manifest.engines if e.model == model and e.role is Role.FILL]
        entries = [e for e in manifest.engines if e.model == model and e.role is not Role.FILL]
        assert {e.path for e in entries} == {f"{model}.onnx"}
        # a drafter's fill graph (its cache outputs alone, ort-gqa) is another file, at batch 1 only
        assert {(e.path, e.batch) for e in fills} == ({(f"{model}.fill.onnx", 1)} if model != "target" else set())
        assert manifest.batch_sizes(model) == list(BATCHES)
        single = {(e.role, e.tokens) for e in entries if e.batch == 1 and e.role in BATCHED_ROLES}
        for b in BATCHES[1:]:
            assert {(e.role, e.tokens) for e in entries if e.batch == b} == single, (model, b)
            for e in (e for e in entries if e.batch == b):
                assert e.inputs[INPUT_IDS].shape == (b, e.tokens) and e.inputs[VALID_TOKENS].shape == (b,)
        assert not [e for e in entries if e.batch > 1 and e.role in (Role.PREFILL, Role.PROBE)]


def test_the_build_checked_each_batched_graph_row_by_row(batched_engines):
    for entry in read_manifest(batched_engines).engines:
        if entry.batch == 1:
            continue
        parity = entry.parity
        assert parity["reference"] == "the batch-1 graph, row by row", entry.name
        assert parity["padding_untouched"] is True
        assert [tuple(r) for r in parity["rows"]] == row_plan(entry.batch, entry.tokens, TINY_SHAPE["max_seq_len"])
        if entry.model != "quantized-self":  # fp32: the rows equal batch 1 to float noise
            assert parity["argmax_agreement"] == 1.0 and parity["max_abs_logit_diff"] < 1e-4, entry.name


def test_row_plan_has_ragged_lengths_and_counts_and_an_idle_row():
    rows = row_plan(4, 6, 160)
    assert rows[-1] == (0, 0)
    assert len({length for length, _ in rows[:-1]}) == 3 and len({valid for _, valid in rows[:-1]}) == 3
    assert row_plan(1, 6, 160) == [(154, 6)]  # one row: the cache nearly full


def test_a_batched_run_equals_each_row_alone_in_the_runtime(batched_engines):
    """Outside the build: the runtime's engines of one file, rows at different positions with
    different valid counts, against batch 1 (greedy tokens and the cache each row wrote)."""
    manifest = read_manifest(batched_engines)
    info = manifest.models["target"]
    shared = SharedGraphs()
    verify = next(e for e in manifest.engines if e.model == "target" and e.batch == 4 and e.role == Role.VERIFY)
    single = next(e for e in manifest.engines if e.model == "target" and e.batch == 1 and e.tokens == verify.tokens)
    engine = OrtEngine(verify.name, batched_engines / verify.path, verify.inputs, verify.outputs, EngineOptions(), shared)
    one = OrtEngine(single.name, batched_engines / single.path, single.inputs, single.outputs, EngineOptions(), shared)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, size=n) for n in (30, 7, 51)]
    pipe = load(batched_engines)
    rows = KVCache(info.num_layers, 4, info.num_kv_heads, info.max_seq_len, info.head_dim)
    alone = []
    for r, prompt in enumerate(prompts):  # each row's cache from its own batch-1 prefill
        pipe.target.cache.set_length(0)
        pipe.target.forward(prompt.tolist())
        for name, array in pipe.target.cache.view().items():
            rows.view()[name][r] = array[0]
        alone.append({name: array.copy() for name, array in pipe.target.cache.view().items()})
    before = {name: array.copy() for name, array in rows.view().items()}
    ids = rng.integers(3, 250, size=(4, verify.tokens))  # [4, T]
    valid = np.array([verify.tokens, 2, 1, 0])
    lengths = np.array([len(p) for p in prompts] + [0])
    out = engine.run({**rows.view(), INPUT_IDS: ids, CACHE_LENGTH: lengths, VALID_TOKENS: valid},
                     None, rows.in_place_outputs())
    for r in range(3):
        cache = alone[r]
        got = one.run({**cache, INPUT_IDS: ids[r : r + 1], CACHE_LENGTH: lengths[r : r + 1],
                       VALID_TOKENS: valid[r : r + 1]}, None, {k.replace("past_key_values", "present"): v
                                                               for k, v in cache.items()})
        assert np.array_equal(out["next_tokens"][r, : valid[r]], got["next_tokens"][0, : valid[r]]), r
        end = lengths[r] + valid[r]
        for name in cache:
            np.testing.assert_allclose(rows.view()[name][r, :, :end], cache[name][0, :, :end], atol=1e-5)
            # nothing written past the valid tokens (the slots hold an earlier prompt's K/V)
            assert np.array_equal(rows.view()[name][r, :, end:], before[name][r, :, end:])
    assert all(not array[3].any() for array in rows.view().values())  # the idle row: untouched (zeros)
    assert len(shared) == 1


def test_the_batch_1_loop_is_unchanged_by_batched_entries(batched_engines):
    pipe = load(batched_engines)
    baseline = pipe.generate(prompt_ids=list(range(3, 30)), drafter="none", max_new_tokens=12)
    for drafter in ("ngram", "quantized-self", "draft-model"):
        assert pipe.generate(prompt_ids=list(range(3, 30)), drafter=drafter,
                             max_new_tokens=12).token_ids == baseline.token_ids, drafter


def test_batch_sizes_lie_in_a_sane_range(tmp_path):
    # (standard attention builds batch sizes above 1 too: tests/exporter/test_batched_standard.py)
    recipe = tiny_recipe(tmp_path / "r.yaml", batch=(1, 0), attention="ort-gqa")
    code, _, err = run_cli("plan", recipe)
    assert code == 2 and "batch sizes must lie in 1..256" in err
