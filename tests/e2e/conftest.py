import os
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import REPO, shared_root


@pytest.fixture(scope="session")
def engines(tmp_path_factory, worker_id) -> Path:
    """The default SmolLM2 engines, built once per run (an unchanged existing build at
    $SPECEXPORT_TEST_ENGINES, default engines/smollm2-135m, is reused in seconds). Under a lock
    that every pytest-xdist worker of the run shares: one builds, the others wait and reuse."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    out = Path(os.environ.get("SPECEXPORT_TEST_ENGINES", REPO / "engines" / "smollm2-135m"))
    with FileLock(shared_root(tmp_path_factory, worker_id, "locks") / "smollm2-engines.lock"):
        build(REPO / "recipes" / "smollm2-135m.yaml", out, False, Reporter(quiet=True), threads=2)
    return out


@pytest.fixture(scope="session")
def int4_engines(tmp_path_factory, worker_id) -> Path:
    """The default model at int4 (recipes/smollm2-135m-int4.yaml), built once per run like
    ``engines`` (an unchanged build at $SPECEXPORT_TEST_INT4_ENGINES, default
    engines/smollm2-135m-int4, is reused)."""
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    out = Path(os.environ.get("SPECEXPORT_TEST_INT4_ENGINES", REPO / "engines" / "smollm2-135m-int4"))
    with FileLock(shared_root(tmp_path_factory, worker_id, "locks") / "smollm2-int4-engines.lock"):
        build(REPO / "recipes" / "smollm2-135m-int4.yaml", out, False, Reporter(quiet=True), threads=2)
    return out
