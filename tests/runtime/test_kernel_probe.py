"""runtime/kernel_probe.py: the one-op graphs it writes compute what the op should, its verdict
per branch (from injected agreements: this CPU cannot be made to take MLAS's AVX2 kernels), and
the load-time check against what an engine was built with."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime import kernel_probe
from specexport.runtime.kernel_probe import (
    Agreement,
    Attention,
    FloatMatMul,
    Probe,
    QuantMatMul,
    check_engine,
    kernel_of,
    kernel_record,
)

SAME = Agreement(one_row_equal=True, rows_equal=True, max_abs_diff=0.0)
ONE_ROW_DIFFERS = Agreement(one_row_equal=False, rows_equal=True, max_abs_diff=1e-6)
ROWS_DIFFER = Agreement(one_row_equal=False, rows_equal=False, max_abs_diff=1e-6)
MATMUL = QuantMatMul(64, 48, 4, 32, 4)
ATTENTION = Attention(4, 2, 16, 64, 0.25)


def _probe(matmul: Agreement, attention: Agreement) -> Probe:
    return Probe(((MATMUL, matmul), (ATTENTION, attention)), threads=2, max_rows=24, max_tokens=8)


@pytest.mark.parametrize(("matmul", "attention", "pad"), [
    (SAME, SAME, "none"),  # AVX512-VNNI with an attention that agrees: nothing to pad
    (SAME, ONE_ROW_DIFFERS, "attention"),  # AVX512-VNNI, blocks of 32: GroupQueryAttention's one-row sgemm
    (ONE_ROW_DIFFERS, SAME, "all"),  # AVX2: MatMulNBits' one-row kernel
    (ONE_ROW_DIFFERS, ONE_ROW_DIFFERS, "all"),
])
def test_the_pad_is_what_disagrees(matmul, attention, pad):
    probe = _probe(matmul, attention)
    assert probe.pad == pad
    assert probe.refusal is None
    assert probe.record()["pad"] == pad


def test_rows_of_multi_row_calls_that_differ_are_refused_in_one_line():
    """Blocks of 64 on AVX512, or a row past 128 on AVX2 with threads: no pad makes them agree."""
    refusal = _probe(ROWS_DIFFER, SAME).refusal
    assert refusal is not None and "\n" not in refusal
    assert "MatMulNBits 64x48 4-bit blocks of 32" in refusal and "block_size" in refusal


def test_a_kernel_record_round_trips():
    for kernel in (MATMUL, FloatMatMul(18, 960), ATTENTION):
        assert kernel_of(kernel_record(kernel)) == kernel


def _dequantized(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, k: int) -> np.ndarray:
    """MatMulNBits' 4-bit weight [K, N]: codes [N, blocks, 16] (two per byte, low nibble first),
    scales [N, blocks], zero points [N, blocks/2] (two per byte)."""
    n, blocks, _ = codes.shape
    q = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, blocks, 32).astype(np.float32)
    zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    return ((q - zp[:, :, None]) * scales[:, :, None]).reshape(n, blocks * 32)[:, :k].T


def test_the_probe_graph_computes_matmulnbits_as_its_weights_say():
    """The raw-protobuf graph (attributes, initializers, com.microsoft) is the op it claims: at
    accuracy level 1 (fp32 compute) it computes x @ the dequantized weight."""
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    kernel = QuantMatMul(64, 48, 4, 32, 1)
    graph = kernel.model(np.random.default_rng(0))
    rng = np.random.default_rng(0)  # the same draws as model()
    codes = rng.integers(0, 256, (48, 2, 16), dtype=np.uint8)
    scales = rng.random((48, 2), dtype=np.float32) * 0.02 + 0.001
    zero_points = rng.integers(0, 256, (48, 1), dtype=np.uint8)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)  # [5, K]
    session = ort.InferenceSession(graph, session_options(ort, None), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]  # [5, N]
    np.testing.assert_allclose(got, x @ _dequantized(codes, scales, zero_points, 64), rtol=1e-4, atol=1e-5)


def test_the_attention_graph_runs_and_its_rows_of_multi_row_calls_agree():
    """The probe's GroupQueryAttention graph runs the way the runtime calls it, and rows of
    calls of 2, 3 and 8 tokens agree (a multi-row call's rows do not depend on the count)."""
    agreement = Attention(4, 2, 16, 64, 0.25).agreement(threads=1, max_rows=8, max_tokens=8)
    assert agreement.rows_equal


def _record(pad: str) -> dict:
    return {"pad": pad, "threads": 2, "max_rows": 24, "max_tokens": 8,
            "kernels": [{**kernel_record(MATMUL), **SAME.__dict__}, {**kernel_record(ATTENTION), **SAME.__dict__}]}


def _prober(probe: Probe):
    def prober(kernels, threads, max_rows, max_tokens):
        assert set(kernels) == {MATMUL, ATTENTION} and (max_rows, max_tokens) == (24, 8)
        return probe
    return prober


def test_an_engine_built_without_the_pad_this_cpu_needs_is_refused_naming_the_rebuild():
    refusal = check_engine(_record("attention"), 2, "engines: model 'target'", _prober(_probe(ONE_ROW_DIFFERS, SAME)))
    assert refusal is not None and "\n" not in refusal
    assert "model 'target'" in refusal and "rebuild" in refusal and "'all'" in refusal


def test_an_engine_padded_as_much_as_or_more_than_needed_loads():
    for built, here in (("all", _probe(SAME, ONE_ROW_DIFFERS)), ("attention", _probe(SAME, ONE_ROW_DIFFERS)),
                        ("none", _probe(SAME, SAME))):
        assert check_engine(_record(built), 2, "x", _prober(here)) is None, built


def test_a_cpu_whose_multi_row_calls_disagree_is_refused_at_load():
    refusal = check_engine(_record("all"), 2, "x", _prober(_probe(ROWS_DIFFER, SAME)))
    assert refusal is not None and "no pad makes" in refusal


def test_an_engine_from_before_the_probe_is_not_probed():
    def never(*args):
        raise AssertionError("probed")
    assert check_engine(None, 2, "x", never) is None


def test_this_cpus_probe_runs_every_kernel_once():
    """The real probe, memoized per process: the same kernels twice are probed once."""
    kernel_probe._probe_cached.cache_clear()
    first = kernel_probe.probe([MATMUL, MATMUL, FloatMatMul(64, 8)], 1, 8, 4)
    assert [k for k, _ in first.kernels] == [MATMUL, FloatMatMul(64, 8)]
    assert kernel_probe.probe([MATMUL, FloatMatMul(64, 8)], 1, 8, 4) is first


def test_bench_says_what_each_quantized_model_pads_and_why():
    from specexport.bench.report import _exactness_lines
    from specexport.runtime.kernel_probe import model_exactness_summary

    record = {**_record("attention"), "cpu_flags": ["avx512_vnni"]}
    record["kernels"][1].update(one_row_equal=False)  # the attention differs alone
    head = {**_record("none"), "kernels": [kernel_record(MATMUL), kernel_record(QuantMatMul(48, 64, 8, 32, 4))]}
    summaries = {"target": model_exactness_summary({"quantization": {"exactness": record}}),
                 "old": model_exactness_summary({"quantization": {"bits": 4}}),
                 "head": model_exactness_summary({"weights_quantized": {"bits": 8, "exactness": head}}),
                 "old-head": model_exactness_summary({"weights_quantized": {"bits": 8}}),
                 "fp32": model_exactness_summary({})}
    assert summaries["fp32"] is None
    assert summaries["head"]["agrees_alone"] == [kernel_probe.describe(MATMUL),
                                                 kernel_probe.describe(QuantMatMul(48, 64, 8, 32, 4))]
    lines = _exactness_lines({"exactness": {k: v for k, v in summaries.items() if v}})
    assert lines[0] == ("Exactness: target's one-token calls pad attention (exact alone: 1 MatMulNBits; differs "
                        "alone: GroupQueryAttention 4/2 heads of 16; CPU flags avx512_vnni).")
    assert lines[1] == "Exactness: old's one-token calls pad all (built before the probe)."
    assert lines[2] == "Exactness: head's one-token calls pad none (exact alone: 2 MatMulNBits)."
    assert lines[3] == "Exactness: old-head's one-token calls pad none (built before the probe)."
