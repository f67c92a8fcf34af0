"""What `specexport serve` refuses at start, in one line, instead of answering 503 to every
request: a target with linear-attention layers (a recurrent state per sequence runs at batch 1
only, and the server batches). The same through Ray Serve's entry points."""

from __future__ import annotations

import pytest

import specexport.serve.app
from specexport.errors import BadInput
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def hybrid_engines(tiny_engines):
    """The shared Qwen3-Next build (ort-gqa, onnxruntime engines: every other start-up check passes)."""
    return tiny_engines.for_arch("qwen3_next", "ort-gqa")


def test_serve_refuses_a_hybrid_target_at_start_in_one_line(hybrid_engines, monkeypatch):
    def got_past_the_checks(config, **kw):  # instead of serving (and blocking) on a refusal that is missing
        raise AssertionError(f"serve started on {config.engine_dir}")

    monkeypatch.setattr(specexport.serve.app, "create_app", got_past_the_checks)
    code, _, err = run_cli("serve", str(hybrid_engines), "--port", "0")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(hybrid_engines) in err and "linear-attention" in err and "batch 1" in err, err


def test_ray_serve_refuses_a_hybrid_target_before_any_replica_starts(hybrid_engines):
    from specexport.serve.ray_app import app_builder

    # `serve run specexport.serve.ray_app:app_builder engine_dir=DIR`: refused on the driver
    with pytest.raises(BadInput, match="linear-attention") as refused:
        app_builder({"engine_dir": str(hybrid_engines)})
    assert "\n" not in str(refused.value) and str(hybrid_engines) in str(refused.value)
