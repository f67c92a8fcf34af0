"""The device store (runtime/device_store.py) on the CPU: its verbs do to OrtValues bound by
address what the host store does to numpy arrays; a decode step and a verify round copy no
cache bytes between host and engines (the host store, the control, copies the whole cache);
the CUDA graph settings an engine on cuda would run with; and the hand-written copy graph is
valid ONNX. Decoding through the device store is checked lossless by the lossless tests
themselves (test_pipeline.py, test_tree_decode.py, test_batch_decode.py run it too)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specexport.contract import present_of
from specexport.runtime import load
from specexport.runtime.cache_store import HostStore
from specexport.runtime.device_binding import GRAPH_ID, graph_run_options, with_cuda_graphs
from specexport.runtime.device_store import DeviceStore, DeviceTensor, PositionCopier
from specexport.runtime.engine import SharedGraphs
from specexport.runtime.tree import DraftTree
from tests.conftest import TINY_SHAPE

SHAPE = (3, 2, 12, 4)  # [slots, n_kv, S_max, hd]


def _device(array: np.ndarray) -> DeviceTensor:
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype, "cpu", 0)
    value.update_inplace(np.ascontiguousarray(array))
    return DeviceTensor(value, value.data_ptr(), array.shape, array.dtype, "cpu")


def _pair(rng: np.random.Generator) -> tuple[HostStore, DeviceStore]:
    host = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("past_key_values.0.key",
                                                                            "past_key_values.0.value")}
    device = DeviceStore({name: _device(a) for name, a in host.items()}, PositionCopier("cpu"))
    return HostStore({name: a.copy() for name, a in host.items()}), device


def _presents(rng, store: HostStore, tokens: int) -> tuple[dict, dict]:
    host = {p: rng.standard_normal((SHAPE[0], SHAPE[1], tokens, SHAPE[3])).astype(np.float32) for p in store.presents}
    return host, {p: _device(a) for p, a in host.items()}


def _assert_same(host: HostStore, device: DeviceStore) -> None:
    got = device.host_copy()
    for name, array in host.rows().items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_every_verb_does_what_the_host_store_does():
    rng = np.random.default_rng(0)
    host, device = _pair(rng)
    _assert_same(host, device)
    host_out, device_out = _presents(rng, host, 5)
    for store, out in ((host, host_out), (device, device_out)):
        store.write(out, [(0, 3, 2), (2, 6, 5)])  # rows 0 and 2 append; row 1 idles
    _assert_same(host, device)
    for store in (host, device):
        store.move(2, 1, 9)
        store.compact(0, 2, [0, 2, 3, 6])  # in place: positions 2, 4, 5, 8 down to 2..5
    _assert_same(host, device)
    for store, out in ((host, host_out), (device, device_out)):
        store.compact(1, 4, [0, 1, 4], out)  # from an appending pass's presents
        store.slot(2).write({p: v[2:3] if isinstance(v, np.ndarray) else v.rows(2, 1) for p, v in out.items()},
                            [(0, 1, 3)])  # one slot's view writes its own row
    _assert_same(host, device)
    source_host, source_device = _pair(rng)  # another model's cache of the same layout
    for store, source in ((host, source_host), (device, source_device)):
        store.slot(1).take(source.slot(1), 2, 5)  # the int4 copy's row taking its target's positions
    _assert_same(host, device)
    np.testing.assert_array_equal(host.rows()["past_key_values.0.key"][1, :, 2:7],
                                  source_host.rows()["past_key_values.0.key"][1, :, 2:7])


def test_save_and_restore_put_back_what_a_timing_run_overwrote():
    rng = np.random.default_rng(1)
    host, device = _pair(rng)
    saved = device.save(2, 7)
    _, out = _presents(rng, host, 5)
    device.write(out, [(0, 7, 5), (1, 8, 4), (2, 7, 5)])
    device.restore(saved, 2, 7)
    got = device.host_copy()
    for name, array in host.rows().items():
        np.testing.assert_array_equal(got[name][:2], array[:2])  # the saved rows put back
        assert not np.array_equal(got[name][2], array[2])  # the third was not saved: still overwritten


def _decode_copies(engines, device_store: bool):
    """What one decode step, one chain verify of 4 and one tree round copy (after a prefill)."""
    pipe = load(engines, threads=2, device_store=device_store)
    runner = pipe.target
    runner.cache.set_length(0)
    runner.forward(np.arange(1, 20, dtype=np.int64))  # prefill
    before = pipe.copies.snapshot()
    runner.forward([7])
    step = pipe.copies.since(before)
    before = pipe.copies.snapshot()
    runner.forward([7, 8, 9, 10])
    chain = pipe.copies.since(before)
    target = pipe.model("target")
    verifier = pipe.tree_verifier(target)
    length = runner.cache.length
    tree = DraftTree(np.array([3, 4, 5, 6], dtype=np.int64), np.array([-1, -1, 1, 1], dtype=np.int64))
    before = pipe.copies.snapshot()
    verifier.verify([(length, 2)], [tree], want_logits=True)
    verifier.commit(length, [1, 3])  # a path of non-adjacent rows: compacted
    tree_round = pipe.copies.since(before)
    return step, chain, tree_round


@pytest.mark.parametrize("attention", ["ort-gqa", "standard"])
def test_a_decode_step_and_a_verify_round_copy_no_cache_bytes(tiny_engines, attention):
    engines = tiny_engines.get("llama", drafters=("ngram",), attention=attention, tree_nodes=6, **TINY_SHAPE)
    for counted in _decode_copies(engines, device_store=True):
        assert counted.cache_bytes == 0, counted
        assert counted.to_device_other > 0 and counted.to_host_other > 0  # tokens in, next tokens out
    # the control: the host store's arrays go in and out whole every run
    for counted in _decode_copies(engines, device_store=False):
        assert counted.to_device_cache > 0 and counted.to_host_cache > 0, counted


def test_the_device_store_binds_every_input_at_one_address_run_after_run(tiny_engines):
    """What CUDA graphs need: a run replays at the addresses it was captured at, so every feed is
    staged into the same buffer before each run and the cache is bound where it lives."""
    pipe = load(tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", tree_nodes=6, **TINY_SHAPE),
                threads=2, device_store=True)
    runner = pipe.target
    runner.cache.set_length(0)
    runner.forward([1, 2, 3])
    engine = runner._calls[1].engine.open()
    runner.forward([4])
    (binding,) = engine._device_bindings.values()
    addresses = {name: value.data_ptr() for name, value in binding.staged.items()}
    assert addresses and "input_ids" in addresses
    runner.forward([5])
    assert engine._device_bindings[next(iter(engine._device_bindings))] is binding
    assert {name: value.data_ptr() for name, value in binding.staged.items()} == addresses
    assert binding.staged["input_ids"].numpy()[0, 0] == 5  # the last run's token, staged in place
    cache = runner.cache.rows_store.rows()
    assert all(isinstance(t, DeviceTensor) for t in cache.values())
    assert runner.cache.rows_store.bound() == {present_of(n): t for n, t in cache.items()}


def test_cuda_graph_settings():
    """The parts of CUDA graph capture that the CPU can check (the capture itself needs a GPU):
    the CUDA provider's option, a graph id per static shape on a session, and the run option."""
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert with_cuda_graphs(providers, True) == [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                                 "CPUExecutionProvider"]
    assert with_cuda_graphs(providers, False) == providers
    shared = SharedGraphs()
    assert [shared.graph_id(("a",)), shared.graph_id(("a",)), shared.graph_id(("b",))] == [1, 2, 1]
    assert graph_run_options(ort, 2).get_run_config_entry(GRAPH_ID) == "2"
    assert graph_run_options(ort, None) is None


def test_the_copy_graph_is_valid_onnx():
    onnx = pytest.importorskip("onnx")
    from specexport.runtime.onnx_bytes import copy_positions_graph

    model = onnx.load_from_string(copy_positions_graph(3, "float16"))
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["GatherND", "ScatterND"] * 3


def test_an_engine_over_a_device_store_still_runs_a_host_cache(tiny_engines):
    """The exporter's checks feed an engine their own numpy cache, bound in place: with the
    device store on, such feeds run as on the host (the same outputs), not through a binding."""
    engines = tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", tree_nodes=6, **TINY_SHAPE)
    outs = []
    for device_store in (False, True):
        pipe = load(engines, threads=2, device_store=device_store)
        engine = pipe.target._calls[1].engine.open()
        info = pipe.manifest.models["target"]
        store = HostStore.allocate(info.num_layers, info.kv.shape(1), info.kv_dtype)
        feeds = {name: np.zeros(spec.shape, dtype=spec.dtype) for name, spec in engine.inputs.items()
                 if name not in store.names}
        feeds["input_ids"][:] = 5
        if "valid_tokens" in feeds:
            feeds["valid_tokens"][:] = 1
        out = engine.run({**store.rows(), **feeds}, ["logits"], store.bound())
        outs.append((out["logits"], store.rows()["past_key_values.0.key"][0, :, 0].copy()))
        assert not getattr(engine, "_device_bindings", {})
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert np.abs(outs[1][1]).sum() > 0  # the in-place graph wrote position 0 of the host cache
