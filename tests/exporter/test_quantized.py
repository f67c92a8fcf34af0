"""precision: int4 — a quantized target (and draft model) built, validated against its own
dequantized weights, and decoded exactly: speculative output equal to the quantized target
alone, bit for bit, at batch 1 and batched; sampled output distributed as the quantized target's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from specexport.contract import CACHE_LENGTH, INPUT_IDS, LOGITS, VALID_TOKENS
from specexport.exporter.exact_rows import DESCRIPTIONS
from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from tests.conftest import (
    NEAR_COPY,
    PROMPTS,
    TINY_SHAPE,
    check_one_line,
    one_verify_copy,
    run_cli,
    tiny_recipe,
)
from tests.lossless import (
    assert_sampled_as_target,
    exact_sequence_probs,
    residual_keeps_the_rejected_token,
    sample_counts,
    use_rule,
)

DRAFTERS = ("ngram", "near-copy")


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    """The tiny llama at int4, batch 1 and 2, with the n-gram drafter and a draft model close
    enough to the target that its drafts are often kept (NEAR_COPY, at int4 too)."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    root = tmp_path_factory.mktemp("int4")
    recipe = tiny_recipe(root / "r.yaml", attention="ort-gqa", batch=(1, 2), precision="int4",
                         drafters=[{"kind": "ngram", "max_ngram": 3}, NEAR_COPY], **TINY_SHAPE)
    build(recipe, root / "engines", False, Reporter(quiet=True))
    return root / "engines"


def prompts(n: int) -> list[str]:
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r["messages"][-1]["content"][:60] if "messages" in r else r["prompt"][:60] for r in records[:n]]


def test_the_manifest_says_what_was_quantized_and_validated(int4_dir):
    manifest = json.loads((int4_dir / "manifest.json").read_text())
    for model in ("target", "near-copy"):
        quant = manifest["models"][model]["quantization"]
        assert quant["precision"] == "int4" and quant["accuracy_level"] == 4 and quant["bits"] == 4
        # padded as this CPU's kernels need (exporter/exact_rows.py; each verdict: test_exact_rows.py)
        assert quant["one_row_calls"] == DESCRIPTIONS[quant["exactness"]["pad"]]
        assert {k["op"] for k in quant["exactness"]["kernels"]} >= {"MatMulNBits", "GroupQueryAttention"}
        assert sum(kind["weights"] for kind in quant["weights"].values()) > 0
    graph = onnx.load(str(int4_dir / "target.onnx"), load_external_data=False)
    ops = {n.op_type for n in graph.graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops  # the head too: nothing left in fp32
    for entry in manifest["engines"]:
        if entry["model"] != "target":
            continue
        parity = entry["parity"]
        assert parity["precision"] == "int4/acc4" and parity["enforced"], entry["name"]
        if entry["batch"] == 1:
            assert parity["rows_agree_max_abs_diff"] == 0.0, entry["name"]
        else:
            assert parity["rows_equal_batch_1"] is True, entry["name"]


def _one_token_against_rows(path, unpad: bool, tmp_path) -> float:
    """Max |Δlogit| between one-token calls and a 4-token call over the same positions, over a
    few token sequences (whether the kernels' different summation orders round differently
    depends on the values: one sequence alone showed none after a change of the RoPE table below
    2e-6)."""
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    model = onnx.load(str(path), load_external_data=False)
    if unpad:  # the pad (whole graph or attention) wants max(2 - T, 0) rows: with 1 in place of 2 it never pads
        init = next(t for t in model.graph.initializer if t.name == "rowpad_two")
        init.CopyFrom(numpy_helper.from_array(np.array([1], dtype=np.int64), "rowpad_two"))
    copy = tmp_path / ("unpadded.onnx" if unpad else "padded.onnx")
    onnx.save(model, str(copy))
    shutil.copy(path.with_name("target.weights"), tmp_path / "target.weights")
    session = ort.InferenceSession(str(copy), session_options(ort, None), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    shapes = {i.name: i.shape for i in session.get_inputs()}
    past = {name: np.zeros([1, *shape[1:]], dtype=np.float32) for name, shape in shapes.items()
            if name.startswith("past")}  # [1, n_kv, S_max, hd]
    worst = 0.0
    for ids in (np.arange(40, 60, dtype=np.int64), *(np.random.default_rng(seed).integers(3, 250, size=20)
                                                      for seed in range(4))):
        worst = max(worst, _one_token_diff(session, names, past, ids))
    return worst


def _one_token_diff(session, names: list[str], past: dict[str, np.ndarray], ids: np.ndarray) -> float:
    """One sequence's max |Δlogit| of _one_token_against_rows (``past``: zeroed caches, overwritten)."""
    def run(start: int, count: int) -> np.ndarray:
        feeds = {**past, INPUT_IDS: ids[start : start + count][None, :], CACHE_LENGTH: np.array([start]),
                 VALID_TOKENS: np.array([count])}
        out = dict(zip(names, session.run(None, feeds)))
        past.update({n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")})
        return out[LOGITS][0]  # [count, V]

    run(0, 8)  # a prompt in the cache
    saved = {n: v.copy() for n, v in past.items()}
    many = run(8, 4)  # [4, V]
    past.update(saved)
    ones = np.concatenate([run(8 + i, 1) for i in range(4)])  # [4, V]
    return float(np.abs(many - ones).max())


def test_one_token_calls_compute_what_verify_computes_and_would_not_unpadded(int4_dir, tmp_path):
    """The control: the same graph without its pad row gives one-token calls other logits than a
    verify pass over the same tokens (MatMulNBits' one-row kernel), which a lossless loop cannot
    have."""
    assert _one_token_against_rows(int4_dir / "target.onnx", unpad=False, tmp_path=tmp_path) == 0.0
    assert _one_token_against_rows(int4_dir / "target.onnx", unpad=True, tmp_path=tmp_path) > 1e-6


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_output_equals_the_int4_target_alone_exactly(int4_dir, drafter):
    pipe = load(int4_dir)
    kept = 0
    for prompt in prompts(6):
        alone = pipe.generate(prompt, max_new_tokens=48, drafter="none")
        spec = pipe.generate(prompt, max_new_tokens=48, drafter=drafter, adaptive=False)  # D every round
        assert spec.token_ids == alone.token_ids, (drafter, prompt)  # no near-tie allowance: bit-exact rows
        kept += spec.stats.accepted
    assert kept > 0, "no draft was ever accepted: the test would not exercise verification"


def test_batched_greedy_equals_each_prompt_alone(int4_dir):
    pipe = load(int4_dir)
    texts = prompts(3)
    alone = [pipe.generate(t, max_new_tokens=32, drafter="none").token_ids for t in texts]
    for drafter in ("none", "ngram"):
        together = pipe.generate_batch(texts, drafter=drafter, max_new_tokens=32, adaptive=False, schedule=False)
        assert [g.token_ids for g in together] == alone, drafter


@pytest.mark.parametrize("drafter, prompt, rule", [
    pytest.param("near-copy", "1, 2, 1, 2, 1, 2, 1,", None, id="near-copy-right-rule"),
    pytest.param("ngram", "aagfaagfaagfaag", None, id="ngram-right-rule"),
    pytest.param("ngram", "aagfaagfaagfaag", residual_keeps_the_rejected_token, id="ngram-control")])
def test_sampled_output_follows_the_int4_target(int4_dir, drafter, prompt, rule, monkeypatch):
    """Two sampled tokens: distributed as the int4 target samples them; the same draws under a
    wrong rule fail (the n-gram proposes "g", to which the int4 target's warped p gives about 0.3;
    the wrong rule leaves the rejected token in the residual)."""
    pipe = load(int4_dir)
    sampling = Sampling(temperature=1.5, top_k=8, top_p=0.95)
    ids = pipe.prompt_ids(prompt)
    exact = exact_sequence_probs(pipe, ids, sampling, 2)
    use_rule(monkeypatch, rule)
    draws = 1200
    counts, _ = sample_counts(pipe, ids, draws, drafter=drafter, max_new_tokens=2, temperature=1.5, top_k=8,
                              top_p=0.95, adaptive=False)
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


def test_int4_with_tensorrt_or_a_quantized_self_drafter_is_refused(tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", precision="int4",
                         drafters=[{"kind": "quantized-self"}])
    code, _, err = run_cli("build", recipe, "--out", tmp_path / "out")
    check_one_line(code, err, "quantized-self", "already int4")
    text = (tmp_path / "r.yaml").read_text().replace("drafters:\n- kind: quantized-self\n", "drafters: []\n")
    (tmp_path / "r.yaml").write_text(text + "backends: [onnxruntime, tensorrt]\n")
    code, _, err = run_cli("build", recipe, "--out", tmp_path / "out")
    check_one_line(code, err, "int4", "tensorrt")
    assert not (tmp_path / "out").exists()


def test_int4_with_standard_attention_is_refused_in_one_line(tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="standard", precision="int4")
    code, _, err = run_cli("build", recipe, "--out", tmp_path / "out")
    check_one_line(code, err, "precision int4", "ort-gqa")
    assert not (tmp_path / "out").exists()


def test_a_padded_verify_computes_what_one_token_calls_compute(int4_dir, tmp_path):
    """Three tokens through a larger graph (padding rows) give the logits of three one-token
    calls bit for bit: the one-token graph pads itself to two rows (exporter/row_pad.py), so the
    decode and verify paths are the same kernels. Padded: a batched row shorter than the
    round's widest, or a directory with one verify entry (its copy here)."""
    pipe = load(one_verify_copy(int4_dir, tmp_path / "old"))
    runner = pipe.target
    assert runner.engine_size(3) == 5, "the test needs the verify graph to run three tokens padded"
    runner.cache.set_length(0)
    runner.forward(pipe.prompt_ids("aagfaagfaagf"))
    length = runner.length
    many = runner.forward([70, 71, 72], want_logits=True).logits  # [3, V]
    runner.cache.set_length(length)
    ones = np.concatenate([runner.forward([t], want_logits=True).logits for t in (70, 71, 72)])  # [3, V]
    assert np.array_equal(many, ones), float(np.abs(many - ones).max())


def test_int8_builds_and_decodes_exactly(tmp_path):
    """precision: int8 — 8-bit MatMulNBits everywhere (the head too), the same exactness."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", precision="int8",
                         drafters=[{"kind": "ngram", "max_ngram": 3}], **TINY_SHAPE)
    build(recipe, tmp_path / "engines", False, Reporter(quiet=True))
    manifest = json.loads((tmp_path / "engines" / "manifest.json").read_text())
    assert manifest["models"]["target"]["quantization"]["bits"] == 8
    graph = onnx.load(str(tmp_path / "engines" / "target.onnx"), load_external_data=False)
    bits = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8}
    pipe = load(tmp_path / "engines")
    for prompt in prompts(3):
        alone = pipe.generate(prompt, max_new_tokens=32, drafter="none")
        assert pipe.generate(prompt, max_new_tokens=32, drafter="ngram", adaptive=False).token_ids == alone.token_ids


def _gather_graph(table: np.ndarray, weight: np.ndarray) -> onnx.ModelProto:
    """ids [n] -> embedding rows [n, H] (an output) -> their MatMul with ``weight`` [H, N]."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Gather", ["embed", "ids"], ["rows"], axis=0),
             helper.make_node("MatMul", ["rows", "w"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, table.shape[1]]),
                               helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, weight.shape[1]])],
                              [numpy_helper.from_array(table, "embed"), numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_head_graph_at_int8_gathers_its_embedding_from_exact_blocks():
    """quantize_head_graph: the MatMul becomes 8-bit MatMulNBits and the embedding table 8-bit
    blocks (GatherBlockQuantized). A table on a Q8_0 grid (fp16 scale per 32 values, codes in
    ±127, as SmolLM2's GGUF embedding) comes back bit for bit; the control, a table off any grid,
    does not (and stays within half a step)."""
    import onnxruntime as ort

    from specexport.exporter.quantize import WeightQuant, quantize_head_graph
    from specexport.runtime.ort_engine import session_options

    rng = np.random.default_rng(0)
    vocab, hidden = 50, 64
    scales = rng.uniform(0.001, 0.01, (vocab, hidden // 32)).astype(np.float16).astype(np.float32)  # [V, H/32]
    codes = rng.integers(-127, 128, (vocab, hidden // 32, 32))
    codes[:, :, 0] = 127  # Q8_0's block maximum is always ±127 codes
    on_grid = (codes * scales[..., None]).reshape(vocab, hidden).astype(np.float32)  # [V, H]
    off_grid = rng.normal(0, 0.3, (vocab, hidden)).astype(np.float32)
    weight = rng.normal(0, 0.1, (hidden, 96)).astype(np.float32)
    ids = np.arange(vocab, dtype=np.int64)
    for table, exact in ((on_grid, True), (off_grid, False)):
        model, info = quantize_head_graph(_gather_graph(table, weight), WeightQuant(8, 32, False, 4, 8))
        ops = [n.op_type for n in model.graph.node]
        assert "GatherBlockQuantized" in ops and "MatMulNBits" in ops and "Gather" not in ops, ops
        assert info["embedding_bits"] == 8 and info["matmuls"] == 1
        assert "embed" not in {t.name for t in model.graph.initializer}  # the fp32 table is gone
        session = ort.InferenceSession(model.SerializeToString(), session_options(ort, 1),
                                       providers=["CPUExecutionProvider"])
        rows, out = session.run(None, {"ids": ids})
        assert np.array_equal(rows, table) is exact
        step = np.abs(table).reshape(vocab, -1, 32).max(-1) / 127  # [V, H/32]
        assert (np.abs(rows - table).reshape(vocab, -1, 32) <= step[..., None] / 2 + 1e-7).all()
        assert np.abs(out - table @ weight).max() < 0.05 * np.abs(table @ weight).max()
