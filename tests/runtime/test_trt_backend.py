"""The TensorRT backend: what holds on any machine, and (marked gpu) what needs one.

CPU-only checks: asking for TensorRT where it or a GPU is missing is one line naming the
extra, exit code 2; an engine built for another TensorRT version or GPU is refused with the
exact rebuild command; every cuda-python call in the backend matches the installed
function's signature; the device-side KV append writes what the host cache writes; the
fp16/bf16 cast of a real graph keeps its I/O types and its argmax; and the whole TensorRT
path of the runtime (load, the device KV cache by default, --host-kv, CUDA graphs, a drafter
without TensorRT engines on onnxruntime beside them) on the fake TensorRT and CUDA of
tests/fake_gpu, which run the ONNX graphs with onnxruntime on host memory and hold the runtime
to TensorRT's binding contract: binding mistakes made on purpose fail there, and the right
binding computes what onnxruntime computes.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from specexport.contract import EngineEntry, TensorSpec
from specexport.errors import BadInput
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.trt_engine import (
    CudaDevice,
    check_compatible,
    cuda_device,
    rebuild_command,
    require_tensorrt,
)
from specexport.runtime.trt_store import append_copies
from tests.conftest import check_one_line, copy_engines, run_cli
from tests.gpu import NO_GPU, needs_gpu, without_gpu
from tests.scaffold import as_tensorrt_build, json_from_fake_gpu

REPO = Path(__file__).resolve().parents[2]
BACKEND = [REPO / "runtime" / "trt_engine.py", REPO / "runtime" / "trt_store.py"]  # every cuda-python call


# -- missing TensorRT or GPU: one line, the extra, exit code 2 -------------------------------


@without_gpu
def test_loading_the_tensorrt_backend_names_the_extra(tiny_dir, tmp_path):
    from specexport.runtime import load

    engines = as_tensorrt_build(tiny_dir, tmp_path / "engines", ("target",), fake_plans=False)
    with pytest.raises(BadInput) as err:
        load(engines, backend="tensorrt")
    assert err.value.exit_code == 2
    assert "pip install 'specexport[gpu]'" in str(err.value)
    assert "\n" not in str(err.value)


@without_gpu
@pytest.mark.parametrize("flag", [("--backend", "tensorrt"), ("--device", "tensorrt")])  # the old spelling
def test_generate_with_tensorrt_backend_exits_2(tiny_dir, tmp_path, flag):
    engines = as_tensorrt_build(tiny_dir, tmp_path / "engines", ("target",), fake_plans=False)
    code, _, err = run_cli("generate", engines, *flag, "--prompt", "hi", "-n", "2")
    check_one_line(code, err, "pip install 'specexport[gpu]'")


def test_device_tensorrt_is_the_tensorrt_backend(tiny_dir):
    """One path to TensorRT: --device tensorrt asks for the tensorrt backend's engines, which an
    onnxruntime-only directory lacks, and cannot be given beside another backend."""
    from specexport.runtime import load

    with pytest.raises(BadInput, match="no engines for backend 'tensorrt'"):
        load(tiny_dir, device="tensorrt")
    with pytest.raises(BadInput, match="--device tensorrt is --backend tensorrt"):
        load(tiny_dir, device="tensorrt", backend="onnxruntime")


@without_gpu
def test_build_of_a_tensorrt_recipe_exits_2_before_exporting(tmp_path):
    recipe = tmp_path / "trt.yaml"
    text = (REPO / "recipes" / "tiny-llama.yaml").read_text()
    recipe.write_text(text.replace("name: tiny-llama", "name: tiny-trt") + "backends: [onnxruntime, tensorrt]\n")
    out = tmp_path / "out"
    code, _, err = run_cli("build", recipe, "-o", out, "--quiet")
    check_one_line(code, err, "pip install 'specexport[gpu]'")
    assert err.strip().count("\n") == 0, err  # --quiet: not even a progress line
    assert not out.exists()


@without_gpu
def test_build_from_onnx_names_the_extra_and_leaves_the_directory(tiny_dir, tmp_path):
    from specexport.cli.trt import build_from_onnx
    from specexport.progress import Reporter

    engines = tmp_path / "engines"
    copy_engines(tiny_dir, engines)
    before = sorted(p.name for p in engines.iterdir())
    with pytest.raises(BadInput, match=r"pip install 'specexport\[gpu\]'") as err:
        build_from_onnx(engines, Reporter(quiet=True), precision="fp16")
    assert err.value.exit_code == 2
    assert sorted(p.name for p in engines.iterdir()) == before
    assert not list(tmp_path.glob(".engines.partial-*"))
    code, _, stderr = run_cli("build", "--from-onnx", engines, "--quiet")
    check_one_line(code, stderr, "pip install 'specexport[gpu]'")


@without_gpu
def test_require_tensorrt_is_not_fooled_by_the_type_stubs():
    # tensorrt-stubs installs tensorrt/__init__.pyi, which imports as an empty namespace package
    with pytest.raises(BadInput, match=r"tensorrt is not installed: pip install 'specexport\[gpu\]'"):
        require_tensorrt()


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present")
def test_no_gpu_is_a_clear_error():
    if importlib.util.find_spec("cuda") is None:
        pytest.skip("cuda-python is not installed (it comes with specexport[dev])")
    with pytest.raises(BadInput) as err:
        cuda_device()
    assert err.value.exit_code == 2
    assert "no CUDA GPU is usable here" in str(err.value) and "specexport[gpu]" in str(err.value)


# -- the manifest's version and GPU promise --------------------------------------------------


def entry(version: str, cc: str) -> EngineEntry:
    spec = {"input_ids": TensorSpec("int64", (1, 1))}
    return EngineEntry("target.decode.b1.t1", "target", "decode", "tensorrt", "target.decode.b1.t1.plan", 1, 1,
                       spec, {}, extra={"tensorrt_version": version, "compute_capability": cc,
                                        "device_name": "NVIDIA H200"})


def test_engine_from_another_tensorrt_version_is_refused_with_the_rebuild_command(tmp_path):
    root = tmp_path / "my engines"
    here = CudaDevice(0, "NVIDIA H200", "9.0")
    with pytest.raises(BadInput) as err:
        check_compatible(entry("10.12.0.36", "9.0"), root, "10.13.0.35", here)
    message = str(err.value)
    assert "TensorRT 10.12.0.36" in message and "TensorRT 10.13.0.35" in message
    assert message.endswith(f"specexport build --from-onnx '{root}'")
    assert rebuild_command(root) == f"specexport build --from-onnx '{root}'"


def test_engine_for_another_gpu_architecture_is_refused(tmp_path):
    orin = CudaDevice(0, "Orin", "8.7")
    with pytest.raises(BadInput) as err:
        check_compatible(entry("10.13.0.35", "9.0"), tmp_path, "10.13.0.35", orin)
    assert "compute capability 9.0" in str(err.value) and "is 8.7" in str(err.value)
    assert f"specexport build --from-onnx {tmp_path}" in str(err.value)
    check_compatible(entry("10.13.0.35", "8.7"), tmp_path, "10.13.0.35", orin)  # a match loads


# -- cuda-python calls against the installed bindings ----------------------------------------


def cuda_calls(source: str) -> list[tuple[str, int, int]]:
    """(function, positional args, line) for every cuda_call(cudart, "name", ...) and cudart.name(...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "cuda_call":
            name = node.args[1]
            assert isinstance(name, ast.Constant), ast.dump(node)
            found.append((name.value, len(node.args) - 2, node.lineno))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("cudart", "runtime") \
                or isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "_cudart":
            found.append((f.attr, len(node.args), node.lineno))
    return found


def test_every_cuda_call_matches_the_installed_signature():
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-python is not installed (it comes with specexport[dev])")
    from cuda.bindings import runtime as cudart

    source = "\n".join(path.read_text() for path in BACKEND)
    calls = [(name, nargs, f"{path.name}:{line}") for path in BACKEND for name, nargs, line in cuda_calls(path.read_text())]
    assert len(calls) > 15 and {"cudaMalloc", "cudaMemcpyAsync", "cudaGraphLaunch", "cudaMemcpy2DAsync"} <= {c[0] for c in calls}
    for name, nargs, line in calls:
        fn = getattr(cudart, name, None)
        assert fn is not None, f"{line}: cuda-python has no {name}"
        inspect.signature(fn).bind(*range(nargs))  # raises TypeError on a wrong argument count
    # enum members named as cudart.<Enum>.<member>
    for enum, member in set(re_findall(r"cudart\.(cuda\w+)\.(cuda\w+)", source)):
        assert hasattr(getattr(cudart, enum), member), f"{enum}.{member}"
    assert hasattr(cudart, "cudaStreamNonBlocking")


def re_findall(pattern: str, text: str) -> list[tuple[str, str]]:
    import re

    return re.findall(pattern, text)


def test_the_signature_check_catches_a_wrong_call():
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-python is not installed (it comes with specexport[dev])")
    from cuda.bindings import runtime as cudart

    (name, nargs, _), = cuda_calls('cuda_call(cudart, "cudaMemcpyAsync", dst, src, n, kind)')
    with pytest.raises(TypeError):
        inspect.signature(getattr(cudart, name)).bind(*range(nargs))  # the stream is missing


# -- KV on the device: the append is the host cache's write ----------------------------------


def emulate_copies(cache: np.ndarray, present: np.ndarray, copies) -> None:
    """cudaMemcpy2D semantics on host bytes."""
    dst, src = cache.reshape(-1).view(np.uint8), present.reshape(-1).view(np.uint8)
    for c in copies:
        for row in range(c.height):
            d, s = c.dst_offset + row * c.dpitch, c.src_offset + row * c.spitch
            dst[d : d + c.width] = src[s : s + c.width]


@pytest.mark.parametrize("at, count", [(0, 5), (7, 3), (14, 2)])
def test_device_append_writes_what_the_host_cache_writes(at, count):
    rng = np.random.default_rng(at)
    layers, n_kv, s_max, hd, tokens = 1, 3, 16, 4, 5
    host = KVCache(layers, 1, n_kv, s_max, hd)
    host.length = at
    present = rng.standard_normal((1, n_kv, tokens, hd)).astype(np.float32)  # [B, n_kv, T, hd]
    host.write({"present.0.key": present, "present.0.value": present}, count)
    device = np.zeros((1, n_kv, s_max, hd), np.float32)  # [B, n_kv, S_max, hd]
    emulate_copies(device, present, append_copies(present.shape, 4, s_max, [(0, at, count)]))
    np.testing.assert_array_equal(device, host.view()["past_key_values.0.key"])  # the padding is not written


def test_device_append_writes_only_the_fed_rows_real_positions():
    present = np.arange(4 * 2 * 3 * 2, dtype=np.float32).reshape(4, 2, 3, 2) + 1  # [B, n_kv, T, hd]
    device = np.zeros((4, 2, 8, 2), np.float32)  # [slots, n_kv, S_max, hd]
    emulate_copies(device, present, append_copies(present.shape, 4, 8, [(0, 1, 3), (2, 4, 2)]))
    np.testing.assert_array_equal(device[0, :, 1:4], present[0])
    np.testing.assert_array_equal(device[2, :, 4:6], present[2, :, :2])
    assert not device[0, :, 4:].any() and not device[2, :, :4].any() and not device[2, :, 6:].any()
    assert not device[1].any() and not device[3].any()  # idle rows


def test_device_append_refuses_positions_past_the_cache():
    with pytest.raises(ValueError, match="run past the cache's 8"):
        append_copies((1, 2, 3, 2), 4, 8, [(0, 6, 3)])


# -- precision: the cast copy TensorRT builds in fp16 / bf16 ---------------------------------


def feeds_for(entry_: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (dtype, shape) in entry_["inputs"].items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, 250, size=shape).astype(dtype)
        elif name == "cache_length":
            feeds[name] = np.full(shape, 9, dtype=dtype)
        else:
            feeds[name] = (0.5 * rng.standard_normal(shape)).astype(dtype)
    return feeds


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_keeps_io_and_argmax(tiny_dir, precision):
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from specexport.exporter.trt_build import cast_precision

    manifest = json.loads((tiny_dir / "manifest.json").read_text())
    e = next(x for x in manifest["engines"] if x["name"].startswith("target.verify") and x["backend"] == "onnxruntime")
    path = tiny_dir / e["path"]
    low = cast_precision(onnx.load(str(path)), precision)
    onnx.checker.check_model(low, full_check=True)

    original = onnx.load(str(path), load_external_data=False)
    io = lambda m: [(v.name, v.type.tensor_type.elem_type) for v in [*m.graph.input, *m.graph.output]]  # noqa: E731
    assert io(low) == io(original)
    code = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    types = {v.name: v.type.tensor_type.elem_type for v in low.graph.value_info}
    types.update({t.name: t.data_type for t in low.graph.initializer})
    matmul_inputs = [types.get(x) for n in low.graph.node if n.op_type in ("MatMul", "Gemm") for x in n.input[:2]]
    assert matmul_inputs and all(t == code for t in matmul_inputs)
    norm = [n for n in low.graph.node if n.op_type == "ReduceMean"]
    assert norm and all(types.get(n.output[0]) == onnx.TensorProto.FLOAT for n in norm)  # statistics in fp32

    from specexport.runtime.ort_engine import session_options

    def session(model):  # on the process's one onnxruntime thread pool, like every session of ours
        return ort.InferenceSession(model, session_options(ort, None), providers=["CPUExecutionProvider"])

    feeds = feeds_for(e)
    names = [o.name for o in low.graph.output]
    ref = dict(zip(names, session(str(path)).run(names, feeds)))
    if precision == "fp16":
        got = dict(zip(names, session(low.SerializeToString()).run(names, feeds)))
    else:  # onnxruntime's CPU kernels have no bf16 Mul; the reference evaluator does
        got = dict(zip(names, ReferenceEvaluator(low).run(names, feeds)))
    scale = float(np.abs(ref["logits"]).max())
    tolerance = {"fp16": 0.05, "bf16": 0.2}[precision]  # of the largest logit; a random model is touchy
    error = np.abs(got["logits"] - ref["logits"]).max(axis=-1)  # [B, T]
    assert float(error.max()) < tolerance * scale
    # the argmax agrees wherever fp32's top two are further apart than the error (near-ties may flip)
    top2 = np.sort(ref["logits"], axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * error
    assert clear.any()
    np.testing.assert_array_equal(got["next_tokens"][clear], ref["next_tokens"][clear])
    assert got["next_tokens"].shape == ref["next_tokens"].shape


def test_cast_precision_clips_instead_of_overflowing():
    from specexport.exporter.trt_build import _low_array

    values = np.array([np.finfo(np.float32).min, -np.inf, 1.5, 1e6], np.float32)
    fp16 = _low_array(values, onnx.TensorProto.FLOAT16)
    assert fp16[0] == -65504 and fp16[1] == -np.inf and fp16[2] == 1.5 and fp16[3] == 65504
    bf16 = _low_array(values, onnx.TensorProto.BFLOAT16).astype(np.float32)
    assert np.isfinite(bf16[0]) and bf16[1] == -np.inf


# -- the whole TensorRT path on the fake TensorRT and CUDA of tests/fake_gpu ----------------

PROMPT = "hello hello hello world, hello"
DRAFTERS = ("none", "ngram", "quantized-self", "draft-model")

# Runs in a child interpreter whose `tensorrt` and `cuda` are the fakes; prints one JSON line.
ON_FAKE_GPU = textwrap.dedent(f"""
    import json, sys
    from cuda.bindings import runtime as cudart
    from specexport.runtime import load
    from specexport.runtime.api import Pipeline
    from specexport.runtime.engine import EngineOptions

    root, drafters = sys.argv[1], {DRAFTERS!r}
    out = {{"onnxruntime": {{d: load(root).generate({PROMPT!r}, drafter=d, max_new_tokens=12).token_ids
                             for d in drafters}}}}
    info = load(root).manifest.models["target"]
    out["cache_tensor_bytes"] = info.num_kv_heads * info.max_seq_len * info.head_dim * 4  # one past input
    out["num_layers"] = info.num_layers
    pipes = {{"device": load(root, backend="tensorrt"), "host": load(root, backend="tensorrt", device_kv=False)}}
    pipes["graphs"] = Pipeline(pipes["device"].manifest, EngineOptions(cuda_graphs=True), "tensorrt")
    for key, pipe in pipes.items():
        del cudart.TRAFFIC[:]
        calls = pipe.target.calls
        gens = {{d: pipe.generate({PROMPT!r}, drafter=d, max_new_tokens=12) for d in drafters}}
        out[key] = {{
            "tokens": {{d: g.token_ids for d, g in gens.items()}},
            "backends": {{d: g.backends for d, g in gens.items()}},
            "caches": {{m: type(pipe.runner(m).cache).__name__ for m in ("target", "quantized-self", "draft-model")}},
            "host_to_device": [n for kind, n in cudart.TRAFFIC if kind == "cudaMemcpyHostToDevice"],
            "target_calls": pipe.target.calls - calls,
        }}
    # the command line: generate and bench, the device cache by default and --host-kv
    from tests.conftest import run_cli

    prompts = sys.argv[2]
    commands = {{
        "generate": ["generate", root, "--backend", "tensorrt", "-d", "quantized-self", "-p", {PROMPT!r}, "-n", "8"],
        "bench": ["bench", root, "--backend", "tensorrt", "--prompts", prompts, "-n", "4", "--repeats", "1",
                  "--drafters", "quantized-self", "--out", sys.argv[3], "--json"],
    }}
    for name, args in commands.items():
        for flag in ([], ["--host-kv"]):
            del cudart.TRAFFIC[:]
            code, text, err = run_cli(*args, *flag)
            out[name + "".join(flag)] = {{"code": code, "out": text, "err": err,
                "host_to_device": [n for kind, n in cudart.TRAFFIC if kind == "cudaMemcpyHostToDevice"]}}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def fake_plans_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny build with fake TensorRT plans for the target and the draft model."""
    return as_tensorrt_build(tiny_dir, tmp_path_factory.mktemp("fake-gpu") / "engines", ("target", "draft-model"))


@pytest.fixture(scope="module")
def on_fake_gpu(fake_plans_dir) -> dict:
    """Greedy output of every drafter on onnxruntime, and on TensorRT (device KV cache, host
    cache, device cache with CUDA graphs), with the copies each made; the target and the draft
    model have TensorRT engines, the int4 drafter only onnxruntime ones."""
    engines = fake_plans_dir
    prompts = engines.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "loop", "category": "grounded", "prompt": "1, 2, 3, 1, 2, 3, 1,"}) + "\n")
    return json_from_fake_gpu(ON_FAKE_GPU, engines, prompts, engines.parent / "bench")


@pytest.mark.parametrize("mode", ["device", "host", "graphs"])
def test_tensorrt_pipeline_on_the_fake_gpu_matches_onnxruntime(on_fake_gpu, mode):
    assert on_fake_gpu[mode]["tokens"] == on_fake_gpu["onnxruntime"]


def test_the_device_kv_cache_is_the_default_and_copies_no_cache_per_call(on_fake_gpu):
    device, host = on_fake_gpu["device"], on_fake_gpu["host"]
    size, layers = on_fake_gpu["cache_tensor_bytes"], on_fake_gpu["num_layers"]
    assert device["caches"] == {"target": "DeviceKVCache", "quantized-self": "KVCache", "draft-model": "DeviceKVCache"}
    # the int4 drafter's host cache never goes to the device: no copy of a cache tensor at all
    assert device["target_calls"] > 0 and max(device["host_to_device"]) < size
    # the control: the host cache is copied whole, every past input on every call
    assert host["caches"]["target"] == "KVCache"
    assert host["host_to_device"].count(size) >= host["target_calls"] * 2 * layers


def test_a_drafter_without_tensorrt_engines_runs_on_onnxruntime_beside_them(on_fake_gpu):
    backends = on_fake_gpu["device"]["backends"]
    assert backends["quantized-self"] == {"target": "tensorrt", "quantized-self": "onnxruntime"}
    assert backends["draft-model"] == {"target": "tensorrt", "draft-model": "tensorrt"}
    assert backends["none"] == {"target": "tensorrt"}


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_the_command_line_uses_the_device_cache_unless_host_kv(on_fake_gpu, command):
    size = on_fake_gpu["cache_tensor_bytes"]
    default, host = on_fake_gpu[command], on_fake_gpu[command + "--host-kv"]
    assert default["code"] == 0 and host["code"] == 0, default["err"] + host["err"]
    assert max(default["host_to_device"]) < size
    assert host["host_to_device"].count(size) >= 2 * on_fake_gpu["num_layers"]
    if command == "generate":  # the int4 drafter's backend is shown with the stats
        assert "[quantized-self; quantized-self on onnxruntime]" in default["err"]
        assert default["out"] == host["out"]


# -- the fake TensorRT holds the runtime to TensorRT's binding contract -------------------------

# Opens the target's verify engine on the fake TensorRT once per case, with the binding as the
# runtime makes it ("right") or with one mistake a runtime could make, runs it on the feeds of
# argv[2], and prints per case the error it ended in, or the file of its outputs.
MISBOUND = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import numpy as np
    import tensorrt
    from cuda.bindings import runtime as cudart

    from specexport.errors import SpecexportError
    from specexport.runtime import trt_engine
    from specexport.runtime.engine import EngineOptions
    from specexport.contract import Manifest

    root, feeds, out = Path(sys.argv[1]), dict(np.load(sys.argv[2])), Path(sys.argv[3])
    entry = next(e for e in Manifest.load(root).engines_of("target", "tensorrt") if e.name == sys.argv[4])

    def right(engine):
        pass

    def bound_by_position(engine):  # the engine's i-th tensor gets the manifest's i-th buffer
        for i, ptr in enumerate(engine._device.values()):
            engine._context.set_tensor_address(engine._engine.get_tensor_name(i), ptr)

    def int32_buffer_for_int64_input(engine):  # input_ids sized as int32, copied in as int64
        spec = engine.inputs["input_ids"]
        ptr = trt_engine.cuda_call(cudart, "cudaMalloc", int(np.prod(spec.shape)) * 4)
        engine._device["input_ids"] = ptr
        engine._context.set_tensor_address("input_ids", ptr)

    def output_left_unbound(engine):
        engine._context.set_tensor_address("logits", 0)

    def present_key_and_value_swapped(engine):  # two buffers of one size: no error, other numbers
        key, value = engine._device["present.0.key"], engine._device["present.0.value"]
        engine._context.set_tensor_address("present.0.key", value)
        engine._context.set_tensor_address("present.0.value", key)

    results = {}
    for mistake in (right, bound_by_position, int32_buffer_for_int64_input, output_left_unbound,
                    present_key_and_value_swapped):
        cudart.cudaDeviceReset()  # a fresh device: an illegal access is sticky until then
        del tensorrt.ERRORS[:]
        engine = trt_engine.open_trt_engine(entry, root, EngineOptions())
        mistake(engine)
        try:
            outputs = engine.run(feeds)
        except SpecexportError as err:
            results[mistake.__name__] = {"error": str(err), "logged": list(tensorrt.ERRORS)}
            continue
        np.savez(out / f"{mistake.__name__}.npz", **outputs)
        results[mistake.__name__] = {"outputs": str(out / f"{mistake.__name__}.npz")}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def misbound(fake_plans_dir, tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    """(what each binding case ended in, onnxruntime's outputs on the same feeds)."""
    from specexport.contract import Manifest, engine_to_json
    from specexport.runtime.engine import EngineOptions, open_engine

    manifest = Manifest.load(fake_plans_dir)
    entry = next(e for e in manifest.engines_of("target", "onnxruntime") if e.role == "verify")
    feeds = feeds_for(engine_to_json(entry))
    out = tmp_path_factory.mktemp("misbound")
    np.savez(out / "feeds.npz", **feeds)
    cases = json_from_fake_gpu(MISBOUND, fake_plans_dir, out / "feeds.npz", out, entry.name)
    return cases, open_engine(entry, fake_plans_dir, EngineOptions()).run(feeds)


def test_the_fake_tensorrt_bound_right_computes_what_onnxruntime_computes(misbound):
    cases, reference = misbound
    got = dict(np.load(cases["right"]["outputs"]))
    assert set(got) == set(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("mistake, says", [
    ("bound_by_position", "cudaErrorIllegalAddress"),  # a past tensor read from a smaller buffer
    ("int32_buffer_for_int64_input", "cudaErrorInvalidValue"),  # the int64 copy does not fit
    ("output_left_unbound", "TensorRT execution failed"),
])
def test_the_fake_tensorrt_refuses_a_binding_mistake(misbound, mistake, says):
    """Each mistake ends in the error a GPU gives it, never in outputs (the fake's earlier form
    ran the first two as if they were bound right, and the third wrote to address 0)."""
    case = misbound[0][mistake]
    assert says in case.get("error", ""), case
    if mistake == "output_left_unbound":
        assert case["logged"] == ["enqueueV3: no address was set for logits"]


def test_the_fake_tensorrt_writes_each_output_where_its_name_is_bound(misbound):
    cases, reference = misbound
    got = dict(np.load(cases["present_key_and_value_swapped"]["outputs"]))
    np.testing.assert_allclose(got["present.0.key"], reference["present.0.value"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["present.0.value"], reference["present.0.key"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(reference["present.0.key"], reference["present.0.value"])


def test_the_target_never_falls_back(tiny_dir, tmp_path):
    from specexport.contract import Manifest
    from specexport.runtime.api import Pipeline
    from specexport.runtime.engine import EngineOptions

    manifest = Manifest.load(as_tensorrt_build(tiny_dir, tmp_path / "engines", ("draft-model",), fake_plans=False))
    with pytest.raises(BadInput, match="no tensorrt engines for model 'target'"):
        Pipeline(manifest, EngineOptions(), "tensorrt")


# -- on a GPU with TensorRT ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trt_dir(tmp_path_factory) -> Path:
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    recipe = tmp_path_factory.mktemp("trt") / "tiny-trt.yaml"
    text = (REPO / "recipes" / "tiny-llama.yaml").read_text().replace("name: tiny-llama", "name: tiny-trt")
    recipe.write_text(text + "backends: [onnxruntime, tensorrt]\nprecision: fp32\n")
    out = recipe.parent / "engines"
    build(recipe, out, False, Reporter(quiet=True), threads=1)
    return out


@needs_gpu
def test_gpu_tensorrt_greedy_equals_onnxruntime(trt_dir):
    from specexport.runtime import load

    manifest = json.loads((trt_dir / "manifest.json").read_text())
    trt_entries = [e for e in manifest["engines"] if e["backend"] == "tensorrt"]
    assert trt_entries and not any(e["model"] == "quantized-self" for e in trt_entries)
    assert all(e["extra"]["precision"] == "fp32" and e["extra"]["compute_capability"] for e in trt_entries)
    assert all(e["parity"]["within_tolerance"] and e["parity"]["enforced"] for e in trt_entries)
    ort_pipe, trt_pipe = load(trt_dir, backend="onnxruntime"), load(trt_dir, backend="tensorrt")
    for drafter in ("none", "ngram", "tiny-draft", "quantized-self"):  # int4: onnxruntime beside TensorRT
        a = ort_pipe.generate("hello hello hello", drafter=drafter, max_new_tokens=24)
        b = trt_pipe.generate("hello hello hello", drafter=drafter, max_new_tokens=24)
        assert a.token_ids == b.token_ids, drafter


@needs_gpu
def test_gpu_device_kv_and_cuda_graphs_match_the_host_path(trt_dir):
    from dataclasses import dataclass

    from specexport.contract import Manifest
    from specexport.runtime.engine import EngineOptions
    from specexport.runtime.runner import ModelRunner
    from specexport.runtime.trt_engine import open_trt_engine
    from specexport.runtime.trt_store import DeviceKVCache, DeviceStore

    @dataclass(frozen=True)
    class GraphOptions(EngineOptions):
        cuda_graphs: bool = True

    manifest = Manifest.load(trt_dir)
    info = manifest.models["target"]
    entries = manifest.engines_of("target", "tensorrt")
    tokens = {e.name: e.tokens for e in entries}
    host = ModelRunner("target", [open_trt_engine(e, trt_dir, EngineOptions()) for e in entries],
                       KVCache(info.num_layers, 1, info.num_kv_heads, info.max_seq_len, info.head_dim), tokens)
    engines = [open_trt_engine(e, trt_dir, GraphOptions()) for e in entries]
    cache = DeviceKVCache(DeviceStore.allocate(info.num_layers, info.kv.shape(1), info.kv_dtype), info.num_layers)
    device = ModelRunner("target", engines, cache, tokens)  # type: ignore[arg-type]
    prompt = list(range(3, 40))
    for runner in (host, device):
        runner.forward(prompt)
    a, b = host.forward([5, 6, 7]), device.forward([5, 6, 7])
    np.testing.assert_array_equal(a.next_tokens, b.next_tokens)
    host.rewind(len(prompt) + 1)
    device.rewind(len(prompt) + 1)
    for step in range(6):  # decode steps replay the captured graph
        a, b = host.forward([int(a.next_tokens[-1])]), device.forward([int(b.next_tokens[-1])])
        np.testing.assert_array_equal(a.next_tokens, b.next_tokens, err_msg=f"step {step}")
    cache.close()
