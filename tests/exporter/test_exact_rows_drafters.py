"""exporter/exact_rows.py for drafters (issue 52 item 4): an int4 draft model and an int8 head are
probed, padded (or, a head, refused) and recorded as a quantized target is, and the load check
reads their records. Verdicts are injected (this CPU cannot be made to take MLAS's AVX2 kernels);
the build's own row checks judge the pads."""

from __future__ import annotations

import json

import onnx
import pytest

from specexport.errors import BadInput, SpecexportError
from specexport.runtime import kernel_probe
from specexport.runtime.kernel_probe import check_engine
from tests.conftest import TINY_SHAPE, tiny_recipe
from tests.exporter.test_exact_rows import REAL_PROBE, _forced
from tests.heads.common import build_head_only
from tests.heads.test_eagle3 import recipe as eagle3_recipe
from tests.heads.test_eagle3 import target_config

DRAFT = "dm"


# -- an int4 draft model on an fp32 target --------------------------------------------------------

def _build_draft(tmp_path, monkeypatch, verdict: str):
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    monkeypatch.setattr(kernel_probe, "probe", _forced(verdict))
    tmp_path.mkdir(parents=True, exist_ok=True)
    drafter = {"kind": "model", "name": DRAFT, "precision": "int4",
               "model": {"source": "tiny", "arch": "llama", "seed": 7, "num_layers": 1}}
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", drafters=[drafter], **TINY_SHAPE)
    build(recipe, tmp_path / "engines", False, Reporter(quiet=True))
    return tmp_path / "engines"


def _draft_outputs(engines) -> set[str]:
    graph = onnx.load(str(engines / f"{DRAFT}.onnx"), load_external_data=False)
    return {o for n in graph.graph.node for o in n.output}


def _models(engines) -> dict:
    return json.loads((engines / "manifest.json").read_text())["models"]


def _this_cpu_draft_pad(engines) -> str:
    from specexport.exporter.exact_rows import kernels_in

    graph = onnx.load(str(engines / f"{DRAFT}.onnx"), load_external_data=False)
    record = _models(engines)[DRAFT]["quantization"]["exactness"]
    return REAL_PROBE(kernels_in(graph), record["threads"], record["max_rows"], record["max_tokens"]).pad


@pytest.mark.parametrize(("verdict", "mark", "not_mark"), [("all", "input_ids__padded", "attnpad_pads"),
                                                           ("attention", "attnpad_pads", "input_ids__padded")])
def test_an_int4_draft_model_pads_what_its_probe_says(tmp_path, monkeypatch, verdict, mark, not_mark):
    engines = _build_draft(tmp_path / "all", monkeypatch, "all")
    if verdict == "attention" and _this_cpu_draft_pad(engines) == "all":
        pytest.skip("this CPU's matmuls differ alone (AVX2): only the whole graph's pad is exact here")
    if verdict != "all":
        engines = _build_draft(tmp_path, monkeypatch, verdict)  # validated: rows = one-token calls bit for bit
    models = _models(engines)
    record = models[DRAFT]["quantization"]["exactness"]
    assert record["pad"] == verdict and {"MatMulNBits", "GroupQueryAttention"} <= {k["op"] for k in record["kernels"]}
    assert "quantization" not in models["target"]  # the fp32 target is not probed
    outputs = _draft_outputs(engines)
    assert mark in outputs and not_mark not in outputs


def test_an_int4_draft_model_without_the_pad_its_attention_needs_is_refused(tmp_path, monkeypatch):
    """The control: the probe lying "none" on a CPU whose attention differs alone flips the draft
    model's one-token rows, and the build's row check refuses it."""
    engines = _build_draft(tmp_path / "all", monkeypatch, "all")
    if _this_cpu_draft_pad(engines) == "none":
        pytest.skip("this CPU needs no pad: nothing to flip")
    with pytest.raises(SpecexportError, match=f"{DRAFT}.*rows differ from one-token calls"):
        _build_draft(tmp_path, monkeypatch, "none")


def test_a_cpu_that_needs_more_than_the_draft_model_has_is_refused_at_load(tmp_path, monkeypatch):
    """The load check reads the draft model's own record. A draft built padding the whole graph
    (exact on every CPU) is refused where no pad helps; one built padding only its attention (where
    this CPU's matmuls agree alone, so that build validates) is refused where a matmul differs."""
    from specexport.runtime import load

    engines = _build_draft(tmp_path / "all", monkeypatch, "all")
    monkeypatch.setattr(kernel_probe, "probe", _forced("refuse"))
    with pytest.raises(BadInput, match=f"model '{DRAFT}'.*no pad makes"):
        load(engines, threads=2).model(DRAFT)
    monkeypatch.setattr(kernel_probe, "probe", _forced("attention"))  # padded more than needed: exact
    load(engines, threads=2).model(DRAFT)
    if _this_cpu_draft_pad(engines) == "all":
        pytest.skip("this CPU's matmuls differ alone (AVX2): an attention-only pad does not validate here")
    engines = _build_draft(tmp_path / "attention", monkeypatch, "attention")
    monkeypatch.setattr(kernel_probe, "probe", _forced("all"))
    with pytest.raises(BadInput, match=f"model '{DRAFT}'.*rebuild"):
        load(engines, threads=2).model(DRAFT)


# -- an int8 head (EAGLE-3): no GroupQueryAttention, no pad ------------------------------------------

def _build_head(tmp_path, monkeypatch, verdict: str | None):
    from tests.heads.chain_checkpoints import write_eagle3

    if verdict is not None:
        monkeypatch.setattr(kernel_probe, "probe", _forced(verdict))
    write_eagle3(tmp_path / "spec", target_config(), "speculators", layer_ids=[0, 1, 3])
    raw = eagle3_recipe({"kind": "eagle3", "name": "e", "path": "spec", "precision": "int8"})
    return build_head_only(raw, tmp_path, tmp_path / "out")


def test_an_int8_head_records_the_probe_of_the_kernels_it_uses(tmp_path, monkeypatch):
    builder = _build_head(tmp_path, monkeypatch, "none")
    entry = builder.models["e"]
    record = entry.info["weights_quantized"]["exactness"]
    assert record["pad"] == "none" and entry.exactness == record
    ops = {k["op"] for k in record["kernels"]}
    assert "MatMulNBits" in ops and "GroupQueryAttention" not in ops, ops  # its attention is its own
    assert {k["bits"] for k in record["kernels"] if k["op"] == "MatMulNBits"} == {8}
    assert not entry.full_rows  # a head's calls keep their own valid tokens
    # the load check reads the head's record: a CPU where a row alone differs is refused
    assert check_engine(entry.exactness, 2, "e", prober=_forced("none")) is None
    assert "rebuild" in check_engine(entry.exactness, 2, "e", prober=_forced("all"))


def test_an_int8_head_whose_row_alone_differs_is_refused_in_one_line(tmp_path, monkeypatch):
    """A head's graph has no pad: where the probe finds a kernel that differs alone, the build
    refuses naming the drafter and the fix (before, it went unchecked)."""
    with pytest.raises(BadInput, match=r"drafter 'e' at precision int8: .*differs.*precision: fp32") as err:
        _build_head(tmp_path, monkeypatch, "all")
    assert "\n" not in str(err.value)


def test_an_int8_head_on_this_cpu(tmp_path, monkeypatch):
    """The real probe: what this CPU says of the head's kernels is what the record holds."""
    builder = _build_head(tmp_path, monkeypatch, None)
    record = builder.models["e"].exactness
    assert record["pad"] == "none" and all(k["one_row_equal"] and k["rows_equal"] for k in record["kernels"])


# -- the quantized-self drafter: observed, never padded ---------------------------------------------

def test_the_quantized_self_drafter_is_probed_and_recorded_but_not_padded(tmp_path, monkeypatch):
    """Its rows do not decide the output: even where a matmul differs alone it is not padded, its
    record says so (held: false), the load check leaves it alone, and bench reports it."""
    from specexport.bench.report import _exactness_lines
    from specexport.exporter.builder import build
    from specexport.progress import Reporter
    from specexport.runtime import load
    from specexport.runtime.kernel_probe import model_exactness_summary

    monkeypatch.setattr(kernel_probe, "probe", _forced("all"))
    recipe = tiny_recipe(tmp_path / "r.yaml", attention="ort-gqa", drafters=[{"kind": "quantized-self"}], **TINY_SHAPE)
    engines = tmp_path / "engines"
    build(recipe, engines, False, Reporter(quiet=True))
    info = _models(engines)["quantized-self"]
    record = info["exactness"]
    assert record["pad"] == "none" and record["held"] is False
    assert "MatMulNBits" in {k["op"] for k in record["kernels"]}
    outputs = {o for n in onnx.load(str(engines / "quantized-self.onnx"), load_external_data=False).graph.node
               for o in n.output}
    assert "input_ids__padded" not in outputs and "attnpad_pads" not in outputs
    load(engines, threads=2).model("quantized-self")  # not held: no refusal however the CPU differs
    line = _exactness_lines({"exactness": {"quantized-self": model_exactness_summary(info)}})[0]
    assert line.startswith("Exactness: quantized-self's one-token calls pad none (a drafter not held to agree")
    assert "differs alone: MatMulNBits" in line
