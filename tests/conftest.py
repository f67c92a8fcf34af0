"""Shared fixtures: tiny engine directories built once per session, an in-process CLI runner."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "bench" / "prompts" / "dev.jsonl"


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run `specexport ARGS` in this process, as the console script does: (exit code, out, err)."""
    from specexport.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["specexport", *map(str, args)]
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def tiny_recipe(path: Path, arch: str = "llama", *, drafters=None, name: str | None = None, seed: int = 0,
                max_seq_len: int = 96, prefill_chunk: int = 16, max_draft: int = 4, attention: str = "standard",
                **target) -> Path:
    """Write a recipe for a tiny random model; returns its path."""
    recipe = {
        "name": name or f"tiny-{arch}",
        "target": {"source": "tiny", "arch": arch, "seed": seed, **target},
        "drafters": drafters if drafters is not None else [],
        "shapes": {"batch": 1, "max_seq_len": max_seq_len, "prefill_chunk": prefill_chunk},
        "draft": {"tile": 128, "max_draft": max_draft},
        "attention": attention,
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


ALL_DRAFTERS = [
    {"kind": "ngram", "max_ngram": 3},
    {"kind": "quantized-self", "bits": 4, "block_size": 32},
    {"kind": "model", "name": "draft-model", "model": {"source": "tiny", "arch": "llama", "seed": 7,
                                                        "num_layers": 1}},
]


class TinyEngines:
    """Builds tiny engine directories on demand, once per session per configuration."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[tuple, Path] = {}

    def get(self, arch: str = "llama", *, drafters: bool = True, **shape) -> Path:
        """``shape`` holds tiny_recipe's keyword arguments (max_seq_len, attention, ...)."""
        key = (arch, drafters, tuple(sorted(shape.items())))
        if key not in self._built:
            from specexport.exporter.builder import build
            from specexport.exporter.progress import Reporter

            name = f"{arch}-{'all' if drafters else 'target'}-{len(self._built)}"
            recipe = tiny_recipe(self.root / f"{name}.yaml", arch, name=name,
                                 drafters=ALL_DRAFTERS if drafters else [], **shape)
            # A draft model must share the target's tokenizer: the byte tokenizer always does.
            build(recipe, self.root / name, False, Reporter(quiet=True))
            self._built[key] = self.root / name
        return self._built[key]


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory) -> TinyEngines:
    return TinyEngines(tmp_path_factory.mktemp("tiny-engines"))
