"""`specexport lint --for tensorrt`: graphs TensorRT would reject fail, a real tiny build passes."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from specexport.cli.trt import lint as lint_command
from specexport.exporter.lint import lint_model, lint_tensorrt

REPO = Path(__file__).resolve().parents[2]


def graph(nodes, inputs, outputs, opset=18, initializers=(), domains=()) -> onnx.ModelProto:
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)), opset_imports=imports)


def tensor(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def relu(dtype=TensorProto.FLOAT, shape=(1, 4)) -> onnx.ModelProto:
    return graph([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", dtype, shape)], [tensor("y", dtype, shape)])


# -- graphs that must fail -------------------------------------------------------------------


def test_a_clean_static_graph_passes():
    report = lint_model(relu(), "relu")
    assert (report.status, report.problems) == ("ok", [])


@pytest.mark.parametrize("shape", [("batch", 4), (None, 4)])
def test_dynamic_input_shape_fails(shape):
    report = lint_model(relu(shape=shape), "dynamic")
    assert report.status == "fail"
    assert any("input x has a dynamic shape" in p and "static shapes only" in p for p in report.problems), report.problems


def test_dynamic_output_shape_fails():
    model = graph([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", TensorProto.FLOAT, (1, 4))],
                  [tensor("y", TensorProto.FLOAT, ("n", 4))])
    report = lint_model(model, "dynamic-out")
    assert report.status == "fail" and any("output y has a dynamic shape" in p for p in report.problems)


@pytest.mark.parametrize("op", ["Unique", "Det", "BitShift"])
def test_operator_tensorrt_does_not_import_fails(op):
    ins = ["x", "x"] if op == "BitShift" else ["x"]
    dtype = TensorProto.INT32 if op == "BitShift" else TensorProto.FLOAT
    attrs = {"direction": "LEFT"} if op == "BitShift" else {}
    model = graph([helper.make_node(op, ins, ["y"], **attrs)], [tensor("x", dtype, (4, 4))], [tensor("y", dtype, None)])
    report = lint_model(model, op)
    assert report.status == "fail"
    assert any(f"operator {op} is not supported" in p for p in report.problems), report.problems


def test_custom_domain_operator_fails_and_names_the_plugin():
    model = graph([helper.make_node("AttentionPlugin", ["x"], ["y"], domain="trt")], [tensor("x", TensorProto.FLOAT, (1, 4))],
                  [tensor("y", TensorProto.FLOAT, (1, 4))], domains=["trt"])
    report = lint_model(model, "plugin")
    assert report.status == "fail"
    assert any("trt::AttentionPlugin" in p and "plugin" in p for p in report.problems), report.problems


def test_onnxruntime_contrib_operator_is_skipped_with_the_reason():
    q = helper.make_tensor("w_q", TensorProto.UINT8, (4, 1, 16), bytes(64), raw=True)
    node = helper.make_node("MatMulNBits", ["x", "w_q", "scales"], ["y"], domain="com.microsoft", K=32, N=4, bits=4,
                            block_size=32)
    scales = helper.make_tensor("scales", TensorProto.FLOAT, (4,), [1.0] * 4)
    model = graph([node], [tensor("x", TensorProto.FLOAT, (1, 32))], [tensor("y", TensorProto.FLOAT, (1, 4))],
                  initializers=[q, scales], domains=["com.microsoft"])
    report = lint_model(model, "int4")
    assert report.status == "skip"
    assert "com.microsoft::MatMulNBits" in report.problems[0] and "Q/DQ" in report.problems[0]


@pytest.mark.parametrize("dtype", [TensorProto.STRING, TensorProto.COMPLEX64, TensorProto.UINT16])
def test_dtype_tensorrt_rejects_fails(dtype):
    model = graph([helper.make_node("Identity", ["x"], ["y"])], [tensor("x", dtype, (2,))], [tensor("y", dtype, (2,))])
    report = lint_model(model, "dtype")
    assert report.status == "fail"
    name = TensorProto.DataType.Name(dtype)
    assert any(f"are {name}, a type TensorRT rejects" in p for p in report.problems), report.problems


def test_operator_given_a_type_it_refuses_fails():
    model = graph([helper.make_node("MatMul", ["a", "b"], ["y"])],
                  [tensor("a", TensorProto.INT64, (2, 3)), tensor("b", TensorProto.INT64, (3, 2))],
                  [tensor("y", TensorProto.INT64, (2, 2))])
    report = lint_model(model, "int-matmul")
    assert report.status == "fail"
    assert any("MatMul does not take INT64" in p for p in report.problems), report.problems


def test_uint8_inside_the_network_fails():
    nodes = [helper.make_node("Cast", ["x"], ["u"], to=TensorProto.UINT8), helper.make_node("Cast", ["u"], ["y"], to=TensorProto.FLOAT)]
    model = graph(nodes, [tensor("x", TensorProto.FLOAT, (2,))], [tensor("y", TensorProto.FLOAT, (2,))])
    report = lint_model(model, "uint8")
    assert report.status == "fail"
    assert any("UINT8, which TensorRT allows only as a network input or output" in p for p in report.problems)


def test_opset_outside_the_parser_range_fails():
    model = graph([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", TensorProto.FLOAT, (1, 4))],
                  [tensor("y", TensorProto.FLOAT, (1, 4))], opset=8)
    report = lint_model(model, "old")
    assert report.status == "fail" and any("opset 8 is outside" in p for p in report.problems)


# -- engine directories and the command ------------------------------------------------------


def test_real_tiny_build_passes_and_reports_int4_graphs_as_skipped(tiny_dir):
    report = lint_tensorrt(tiny_dir)
    status = {g.graph: g.status for g in report.graphs}
    assert report.ok, report.render()
    assert all(v == "ok" for k, v in status.items() if k.startswith(("target.", "draft-model."))), status
    int4 = [k for k in status if k.startswith("quantized-self.")]
    assert int4 and all(status[k] == "skip" for k in int4), status
    assert not lint_tensorrt(tiny_dir, strict=True).ok  # --strict counts them


def test_command_exit_codes_and_json(tiny_dir, tmp_path):
    runner = CliRunner()
    good = runner.invoke(lint_command, [str(tiny_dir), "--for", "tensorrt", "--json"])
    assert good.exit_code == 0, good.output
    data = json.loads(good.output)
    assert data["ok"] and {g["status"] for g in data["graphs"]} == {"ok", "skip"}

    strict = runner.invoke(lint_command, [str(tiny_dir), "--strict"])
    assert strict.exit_code == 1 and "SKIP  quantized-self.decode.b1.t1" in strict.output

    bad = tmp_path / "bad"
    bad.mkdir()
    onnx.save(relu(shape=("batch", 4)), str(bad / "dynamic.onnx"))
    onnx.save(relu(), str(bad / "fine.onnx"))
    result = runner.invoke(lint_command, [str(bad), "--for", "tensorrt"])
    assert result.exit_code == 1
    assert "FAIL  dynamic" in result.output and "OK    fine" in result.output and "1 failing" in result.output


def test_command_rejects_a_path_that_is_not_there(tmp_path):
    result = CliRunner().invoke(lint_command, [str(tmp_path / "nowhere")])
    assert result.exit_code != 0 and getattr(result.exception, "exit_code", None) == 2


def test_specexport_lint_exit_codes_through_the_real_cli(tiny_dir):
    from tests.conftest import run_cli

    code, out, _ = run_cli("lint", tiny_dir, "--for", "tensorrt")
    assert code == 0 and "0 failing: ok" in out
    code, out, _ = run_cli("lint", tiny_dir, "--for", "tensorrt", "--strict")
    assert code == 1 and "SKIP" in out
