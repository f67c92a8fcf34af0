"""exporter/exact_rows.py: a quantized graph padded exactly as much as the probe of the machine's
kernels says, per verdict (forced by an injected probe: this CPU cannot be made to take MLAS's
AVX2 kernels, issue 52), with the build's own bit-for-bit row check as the judge, and the
control: no pad where the attention needs one flips the rows, and the build refuses it."""

from __future__ import annotations

import json

import onnx
import pytest

from specexport.errors import SpecexportError
from specexport.exporter.exact_rows import DESCRIPTIONS, kernels_in
from specexport.runtime import kernel_probe
from specexport.runtime.kernel_probe import ATTENTION, MATMUL, Agreement, Probe
from tests.conftest import TINY_SHAPE, check_one_line, run_cli, tiny_recipe

REAL_PROBE = kernel_probe.probe
SAME = Agreement(True, True, 0.0)
ONE_ROW_DIFFERS = Agreement(False, True, 1e-6)
ROWS_DIFFER = Agreement(False, False, 1e-6)


def _forced(verdict: str):
    """A probe that answers ``verdict`` (a pad of PADS, or "refuse") for whatever kernels it is given."""
    def differs(part: str) -> Agreement:
        if verdict == "refuse":
            return ROWS_DIFFER if part == MATMUL else SAME
        wanted = {"none": set(), "attention": {ATTENTION}, "all": {MATMUL}}[verdict]
        return ONE_ROW_DIFFERS if part in wanted else SAME

    def probe(kernels, threads, max_rows, max_tokens):
        return Probe(tuple((k, differs(k.part)) for k in kernels), threads, max_rows, max_tokens)
    return probe


def _build(tmp_path, monkeypatch, verdict: str):
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    monkeypatch.setattr(kernel_probe, "probe", _forced(verdict))
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", precision="int4",
                         drafters=[{"kind": "ngram", "max_ngram": 3}], **TINY_SHAPE)
    build(recipe, tmp_path / "engines", False, Reporter(quiet=True))
    return tmp_path / "engines"


def _graph_ops(engines) -> set[str]:
    graph = onnx.load(str(engines / "target.onnx"), load_external_data=False)
    return {o for n in graph.graph.node for o in n.output}


def _this_cpu_pad(engines) -> str:
    """What the real probe says of the built graph's kernels on this machine."""
    graph = onnx.load(str(engines / "target.onnx"), load_external_data=False)
    record = json.loads((engines / "manifest.json").read_text())["models"]["target"]["quantization"]["exactness"]
    return REAL_PROBE(kernels_in(graph), record["threads"], record["max_rows"], record["max_tokens"]).pad


def test_a_matmul_that_differs_alone_pads_the_whole_graph(tmp_path, monkeypatch):
    engines = _build(tmp_path, monkeypatch, "all")  # the build checks rows = one-token calls bit for bit
    quant = json.loads((engines / "manifest.json").read_text())["models"]["target"]["quantization"]
    assert quant["exactness"]["pad"] == "all" and quant["one_row_calls"] == DESCRIPTIONS["all"]
    ops = {k["op"] for k in quant["exactness"]["kernels"]}
    assert {"MatMulNBits", "GroupQueryAttention"} <= ops
    outputs = _graph_ops(engines)
    assert "input_ids__padded" in outputs and "attnpad_pads" not in outputs


def test_only_the_attention_differing_pads_only_the_attention(tmp_path, monkeypatch):
    engines = _build(tmp_path / "all", monkeypatch, "all")
    if _this_cpu_pad(engines) == "all":
        pytest.skip("this CPU's matmuls differ alone (AVX2): only the whole graph's pad is exact here")
    engines = _build(tmp_path, monkeypatch, "attention")  # validated: rows = one-token calls bit for bit
    quant = json.loads((engines / "manifest.json").read_text())["models"]["target"]["quantization"]
    assert quant["exactness"]["pad"] == "attention" and quant["one_row_calls"] == DESCRIPTIONS["attention"]
    outputs = _graph_ops(engines)
    assert "attnpad_pads" in outputs and "input_ids__padded" not in outputs


def test_no_pad_where_the_attention_needs_one_flips_rows_and_the_build_refuses(tmp_path, monkeypatch):
    """The control: with the probe lying "none" on a CPU whose attention differs alone, one-token
    calls compute other rows than verify, and the build's row check catches it."""
    engines = _build(tmp_path / "all", monkeypatch, "all")
    if _this_cpu_pad(engines) == "none":
        pytest.skip("this CPU needs no pad: nothing to flip")
    with pytest.raises(SpecexportError, match="rows differ from one-token calls"):
        _build(tmp_path, monkeypatch, "none")


def test_a_configuration_no_pad_makes_exact_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_probe, "probe", _forced("refuse"))
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", precision="int4", **TINY_SHAPE)
    code, _, err = run_cli("build", recipe, "--out", tmp_path / "out")
    check_one_line(code, err, "model 'target'", "differ between row counts", "block_size")
    assert not (tmp_path / "out").exists()


def test_a_cpu_that_needs_more_than_the_engine_has_is_refused_at_load(tmp_path, monkeypatch):
    from specexport.errors import BadInput
    from specexport.runtime import load

    engines = _build(tmp_path, monkeypatch, "all")
    monkeypatch.setattr(kernel_probe, "probe", _forced("refuse"))
    with pytest.raises(BadInput, match="no pad makes"):
        load(engines, threads=2)
    monkeypatch.setattr(kernel_probe, "probe", _forced("attention"))  # padded more than needed: exact
    load(engines, threads=2)
