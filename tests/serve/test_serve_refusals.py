"""`specexport serve` and Ray Serve on a hybrid target (linear-attention layers, a recurrent state
per row): both start on it; what is still refused at start, in one line instead of a 503 on
every request, is the TensorRT path, which does not carry the state yet (its build refuses it too,
so the generic "rebuild with backend: tensorrt" would not help)."""

from __future__ import annotations

import pytest

import specexport.serve.app
from specexport.errors import BadInput
from tests.conftest import check_one_line, run_cli


@pytest.fixture(scope="module")
def hybrid_engines(tiny_engines):
    """The shared Qwen3-Next build (ort-gqa, onnxruntime engines)."""
    return tiny_engines.for_arch("qwen3_next", "ort-gqa")


class Started(Exception):
    """Raised in place of serving: the start-up checks let the directory through."""


def test_serve_starts_on_a_hybrid_target(hybrid_engines, monkeypatch):
    served = []

    def started(config, **kw):  # instead of serving (and blocking)
        served.append(config.engine_dir)
        raise Started(config.engine_dir)

    monkeypatch.setattr(specexport.serve.app, "create_app", started)
    run_cli("serve", str(hybrid_engines), "--port", "0")
    assert served == [str(hybrid_engines.resolve())]


def test_serve_refuses_tensorrt_for_a_hybrid_target_in_one_line(hybrid_engines, monkeypatch):
    def started(config, **kw):
        raise AssertionError(f"serve started on {config.engine_dir}")

    monkeypatch.setattr(specexport.serve.app, "create_app", started)
    code, _, err = run_cli("serve", str(hybrid_engines), "--backend", "tensorrt", "--port", "0")
    check_one_line(code, err, str(hybrid_engines), "linear-attention", "TensorRT", "onnxruntime", alone=True)
    assert "rebuild" not in err


def test_ray_serve_builds_a_hybrid_target_s_app_and_refuses_its_tensorrt_path(hybrid_engines):
    pytest.importorskip("ray.serve", reason="the ray extra (pip install 'specexport[ray]')")
    from ray.serve import Application

    from specexport.serve.ray_app import app_builder

    # `serve run specexport.serve.ray_app:app_builder engine_dir=DIR`: built on the driver
    assert isinstance(app_builder({"engine_dir": str(hybrid_engines)}), Application)
    with pytest.raises(BadInput, match="linear-attention") as refused:
        app_builder({"engine_dir": str(hybrid_engines), "backend": "tensorrt"})
    assert "\n" not in str(refused.value) and str(hybrid_engines) in str(refused.value)
