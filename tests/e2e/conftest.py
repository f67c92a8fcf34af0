import os
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="session")
def engines() -> Path:
    """The default SmolLM2 engines, built once per session (an unchanged existing build at
    $SPECEXPORT_TEST_ENGINES, default engines/smollm2-135m, is reused in seconds)."""
    from specexport.exporter.builder import build
    from specexport.exporter.progress import Reporter

    out = Path(os.environ.get("SPECEXPORT_TEST_ENGINES", REPO / "engines" / "smollm2-135m"))
    build(REPO / "recipes" / "smollm2-135m.yaml", out, False, Reporter(quiet=True), threads=2)
    return out
