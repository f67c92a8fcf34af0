"""The docs stay true to the code: the generated reference pages match it byte for byte, every
relative link resolves, and the README's quick start runs top to bottom as written, here on a
tiny random model (tests/e2e/test_readme.py runs it on the default engines).

The quick start is the README's region between `<!-- quickstart -->` and `<!-- /quickstart -->`:
its `bash` blocks run as they are and its `python` blocks through `python -`, in order, in one
shell. A block preceded by `<!-- tiny-run: skip -->` (installing, `make bench`) runs only in the
end-to-end variant.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from specexport import docs
from tests.conftest import REPO, copy_engines

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250


# --- the quick start as a script (tests/e2e/test_readme.py uses these too) --------------------


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string: bash, python, text, ...
    code: str
    tiny_run: bool  # False: marked <!-- tiny-run: skip --> (installs, make bench)


_REGION = re.compile(r"<!-- quickstart -->(.*?)<!-- /quickstart -->", re.S)
_FENCE = re.compile(r"(<!-- tiny-run: skip -->\s*)?^```(\w*)\n(.*?)^```", re.S | re.M)


def quickstart_blocks(readme: str) -> list[Block]:
    region = _REGION.search(readme)
    assert region, "README.md has no <!-- quickstart --> ... <!-- /quickstart --> region"
    return [Block(lang, code, not skip) for skip, lang, code in _FENCE.findall(region.group(1))]


def quickstart_script(blocks: list[Block]) -> str:
    """One bash script that runs the blocks in order, as a reader pastes them (stopping at the
    first failure)."""
    parts = ["set -euo pipefail"]
    for block in blocks:
        if block.lang == "bash":
            parts.append(block.code)
        elif block.lang == "python":
            parts.append(f"python - <<'PYTHON'\n{block.code}PYTHON")
    return "\n".join(parts) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, cwd: Path, log: Path, timeout: float,
               env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``script`` in ``cwd`` with the venv's `specexport` and `python` first on PATH, its
    output going to ``log``; (exit code or None on a timeout, the output). Whatever it left
    running (a server) is stopped with it: the script runs in a process group of its own."""
    environment = {**os.environ, **(env or {})}
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment['PATH']}"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=environment, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, log.read_text()


# --- generated pages ---------------------------------------------------------------------------


def test_generated_reference_pages_match_the_code():
    for name, render in docs.PAGES.items():
        committed = (REPO / "docs" / name).read_text()
        assert committed == render(), f"docs/{name} is stale: run `make docs`"


def test_a_changed_option_makes_the_cli_page_stale(monkeypatch):
    import click

    from specexport.cli import cli

    verify = cli.commands["verify"]
    monkeypatch.setattr(verify, "params", [*verify.params, click.Option(["--fast"], is_flag=True, help="New.")])
    assert "cli.md" in docs.stale_pages()
    assert "| `--fast` | flag | off | New. |" in docs.cli_page()


class _Undocumented(BaseModel):
    documented: int = 1  # a comment documents this key
    bare: int = 2


class _Inner(BaseModel):
    depth: int = 1  # how deep


class _Documented(BaseModel):
    # a cap
    cap: int | None = Field(None, ge=1)  # (None: no cap)
    sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)  # extra sizes
    mode: Literal["auto", "never"] = "auto"  # how
    inner: _Inner = _Inner()  # nested keys


def test_a_recipe_key_without_a_comment_is_refused():
    with pytest.raises(ValueError, match=r"_Undocumented\.bare has no comment"):
        docs._model_section(_Undocumented, "x", {})


def test_recipe_page_renders_each_key_s_type_default_and_comment():
    section = docs._model_section(_Documented, "x", {_Inner: "inner-anchor"})
    assert "| `cap` | integer or null (≥ 1) | `null` | a cap (None: no cap) |" in section
    assert "| `sizes` | list of integer (each ≥ 1) | `[]` | extra sizes |" in section
    assert "| `mode` | `auto` \\| `never` | `auto` | how |" in section
    assert "| `inner` | [_Inner](#inner-anchor) | its keys' defaults ([_Inner](#inner-anchor)) | nested keys |" in section


# --- docs/bench.md: the bench.json schema ---------------------------------------------------------


# Maps keyed by data (drafter names) or written by other code (the manifest's plan, versions, a
# peer's own settings): documented as a whole, not key by key.
_OPAQUE = {"plan", "toolchain", "costs.draft_ms", "costs.draft_parts_ms", "peers[].settings", "exactness"}


def key_paths(data, prefix: str = "") -> set[str]:
    """Every key of a JSON document as a path: `settings.threads`, `results[].speedup`."""
    paths: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            if path not in _OPAQUE:
                paths |= key_paths(value, path)
    elif isinstance(data, list):
        for item in data:
            paths |= key_paths(item, f"{prefix}[]")
    return paths


def undocumented_bench_keys(result: dict) -> list[str]:
    """The keys of a bench result that docs/bench.md does not list (as `path`)."""
    page = (REPO / "docs" / "bench.md").read_text()
    return sorted(path for path in key_paths(result) if f"`{path}`" not in page)


def test_an_undocumented_bench_key_is_found():
    result = {"settings": {"threads": 2, "new_knob": 1}, "results": [{"speedup": 1.0, "acceptance_length_fixed": 1.0}],
              "plan": {"anything": 1}}
    assert undocumented_bench_keys(result) == ["settings.new_knob"]


# --- links -------------------------------------------------------------------------------------


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", _CODE_FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def relative_links(page: Path) -> list[str]:
    text = _CODE_FENCE.sub("", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert len(PAGES) > 5
    broken = {page.name: bad for page in PAGES if (bad := broken_links(page))}
    assert not broken, broken


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope) [web](https://x.org)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "there.md#nope (no such heading)"]


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


# --- the quick start on a tiny model ------------------------------------------------------------


def test_quickstart_has_every_step():
    blocks = quickstart_blocks(README.read_text())
    code = "\n".join(b.code for b in blocks)
    for step in ("make install", "specexport build", "specexport generate", "from specexport.runtime import load",
                 "specexport serve", "from openai import OpenAI", "make bench"):
        assert step in code, step
    assert [b.code.strip() for b in blocks if not b.tiny_run] == [
        b.code.strip() for b in blocks if "make install" in b.code or "make bench" in b.code]


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start waits for the server with curl")
def test_quickstart_runs_as_written_on_a_tiny_model(batched_engines, tiny_engines, tmp_path):
    """The blocks in order, in a folder where recipes/smollm2-135m.yaml is a tiny random model's
    recipe and engines/smollm2-135m its build (a copy of the shared one: `build` finds it up to
    date), with the server on a free port."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(tiny_engines.recipe(batched_engines), tmp_path / "recipes" / "smollm2-135m.yaml")
    copy_engines(batched_engines, tmp_path / "engines" / "smollm2-135m")
    blocks = [b for b in quickstart_blocks(README.read_text()) if b.tiny_run]
    script = quickstart_script(blocks).replace("8000", str(free_port()))
    code, output = run_script(script, tmp_path, tmp_path / "quickstart.log", timeout=300)
    assert code == 0, output
    assert "up to date" in output  # the build block found the copied directory current
