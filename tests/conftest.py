"""Shared fixtures: tiny engine directories built once per session, an in-process CLI runner."""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "bench" / "prompts" / "dev.jsonl"


def pytest_configure(config) -> None:
    """pytest-xdist runs one worker per core (make test): each worker's onnxruntime pool and
    torch get their share of the cores, not all of them. Left at the default, every worker's
    pool had a thread per core, spinning between runs (runtime/ort_engine.py), and torch as
    many: on 2 cores, two workers' four spinning threads fought for two cores (a decode step
    1.8x slower than with one thread each, per runtime/ort_engine.py's table). The pool is
    made here, before any session, so sessions asking for more threads run on it (onnxruntime
    cannot resize it; they warn). Subprocesses the tests start inherit OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # not distributed, or the controller (it runs no test)
    from specexport.runtime.ort_engine import SHARED_POOL, physical_cores

    threads = max(1, physical_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # read OMP_NUM_THREADS at import; set it if already imported
        sys.modules["torch"].set_num_threads(threads)
    try:
        import onnxruntime
    except ImportError:
        return
    if SHARED_POOL.size is None:
        SHARED_POOL.threads_for(onnxruntime, threads)
    config.addinivalue_line("filterwarnings", "ignore:onnxruntime's thread pool was made with:RuntimeWarning")


# The slowest test files, slowest first: seconds per file (fixture setup included) summed from
# --junitxml of a whole run on the 2-core VM, 2026-12-05, two workers, other jobs on the cores.
# pytest-xdist's loadfile hands files out in collection order when told --no-loadscope-reorder
# (make test; by default it sorts them by test count, which left 60-300 s files of few tests,
# the SmolLM2 builds among them, for the end), so the long ones start first and the last files
# handed out are short: no long file runs alone at the end while the other worker idles.
SLOWEST_FILES = [
    "tests/e2e/test_smollm2.py",  # 786
    "tests/e2e/test_smollm2_int4.py",  # 455
    "tests/heads/test_chain_tree.py",  # 182
    "tests/exporter/test_archs.py",  # 150
    "tests/runtime/test_batch_heads.py",  # 115
    "tests/distill/test_distill.py",  # 105
    "tests/heads/test_mtp.py",  # 97
    "tests/heads/test_taps.py",  # 92
    "tests/runtime/test_pipeline.py",  # 90
    "tests/bench/test_peers.py",  # 89
    "tests/heads/test_mtp_gated.py",  # 89
    "tests/heads/test_eagle3.py",  # 86
    "tests/heads/test_tensorrt.py",  # 85
    "tests/runtime/test_batch_hybrid.py",  # ~85 (estimated, 2026-12-06: its own build 42 s, the hybrid builds 32 s)
    "tests/heads/test_dspark.py",  # 81
    "tests/exporter/test_linear_attention.py",  # 81
    "tests/heads/test_block_tree.py",  # 67
    "tests/exporter/test_batched_standard.py",  # 65
    "tests/heads/test_dflash.py",  # 52
    "tests/runtime/test_grammar.py",  # 50
    "tests/exporter/test_build.py",  # 48
    "tests/distill/test_distill_dflash.py",  # 46
    "tests/runtime/test_tree_decode.py",  # 43
    "tests/distill/test_distill_dspark.py",  # 42
    "tests/exporter/test_tree_graph.py",  # 37
    "tests/exporter/test_quantized.py",  # 31
    "tests/e2e/test_smollm2_serve.py",  # 30
    "tests/bench/test_bench.py",  # 29
    "tests/runtime/test_model_tree.py",  # 29
    "tests/runtime/test_hybrid_targets.py",  # 27
    "tests/e2e/test_readme.py",  # 26
    "tests/heads/test_chain_acceptance.py",  # 24
]


def pytest_collection_modifyitems(config, items) -> None:
    """SLOWEST_FILES first, in that order; every other file after them in collection order
    (a stable sort: each file's tests keep their order, module fixtures stay per file)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def copy_engines(src: Path, dst: Path) -> Path:
    """A copy of an engine directory that other test workers may be loading at the same time:
    their atomic writes' in-flight files (``.NAME.partial-PID...``, ``.NAME.old-PID``, such as
    a load's verification record) come and go while it is copied, so they are left out (one
    vanishing mid-copy failed a clean-clone run)."""
    import shutil

    return Path(shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*.partial-*", ".*.old-*")))


def one_verify_copy(src: Path, dst: Path) -> Path:
    """A copy of an ort-gqa directory as built before verify entries at every size: the
    target's largest verify entry alone at each batch size (an old manifest; the same files)."""
    from specexport.contract import Manifest, Role, write_manifest

    copy_engines(src, dst)
    manifest = Manifest.load(dst)
    largest = {}
    for e in manifest.engines:
        if e.model == "target" and e.role == Role.VERIFY:
            largest[(e.backend, e.batch)] = max(largest.get((e.backend, e.batch), 0), e.tokens)
    kept = [e for e in manifest.engines if not (e.model == "target" and e.role == Role.VERIFY
                                                and e.tokens < largest[(e.backend, e.batch)])]
    write_manifest(dst, replace(manifest, engines=kept))
    return dst


def tuned_copy(src: Path, dst: Path, ms_of) -> Path:
    """A copy of an engine directory whose tuned costs (costs.json) are ``ms_of(entry)`` for
    every engine: costs a test chooses, so the runner's plan does not depend on timing noise."""
    import json

    from specexport.contract import Manifest
    from specexport.runtime.costs import COSTS

    copy_engines(src, dst)
    code, _, err = run_cli("tune", dst, "--rounds", "1")  # one round: never too noisy to write
    assert code == 0, err
    costs = json.loads((dst / COSTS).read_text())
    for entry in Manifest.load(dst).engines:
        costs["engines"].setdefault(entry.backend, {})[entry.name] = ms_of(entry)
    (dst / COSTS).write_text(json.dumps(costs))
    return dst


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


def check_one_line(code: int, err: str, *needles: str, alone: bool = False) -> None:
    """A refused command: exit code 2 and one error line, the last thing on stderr (progress
    lines may come before it, none with ``alone``), naming each of ``needles``; no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line]
    errors = [line for line in lines if line.startswith("specexport: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert len(lines) == 1 or not alone, err
    for needle in needles:
        assert needle in errors[0], errors[0]


def tiny_recipe(path: Path, arch: str = "llama", *, drafters=None, name: str | None = None, seed: int = 0,
                max_seq_len: int = 96, prefill_chunk: int = 16, max_draft: int = 4, attention: str = "standard",
                batch: int | tuple[int, ...] = 1, precision: str = "fp32", tree_nodes: int = 0, **target) -> Path:
    """Write a recipe for a tiny random model; returns its path."""
    recipe = {
        "name": name or f"tiny-{arch}",
        "target": {"source": "tiny", "arch": arch, "seed": seed, **target},
        "drafters": drafters if drafters is not None else [],
        "shapes": {"batch": list(batch) if isinstance(batch, tuple) else batch, "max_seq_len": max_seq_len, "prefill_chunk": prefill_chunk},
        "draft": {"tile": 128, "max_draft": max_draft, **({"tree": {"max_nodes": tree_nodes}} if tree_nodes else {})},
        "attention": attention,
    }
    if precision != "fp32":
        recipe["precision"] = precision
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


ALL_DRAFTERS = [
    {"kind": "ngram", "max_ngram": 3},
    {"kind": "quantized-self", "bits": 4, "block_size": 32},
    {"kind": "model", "name": "draft-model", "model": {"source": "tiny", "arch": "llama", "seed": 7,
                                                        "num_layers": 1}},
]


# The shape of the shared tiny builds: long enough for 64 new tokens after the test prompts,
# for the Gemma sliding window (16) to matter, and for a partial last prefill chunk when the
# build's validation fills the cache (159 tokens in chunks of 16).
TINY_SHAPE = dict(max_seq_len=160, prefill_chunk=16)

# The (arch, attention) pairs the runtime decodes losslessly (tests/runtime/test_pipeline.py).
# tests/exporter/test_archs.py checks the parity of every pair through the same builds: these
# with drafters, the others target-only.
LOSSLESS_PAIRS = [("llama", "standard"), ("qwen3", "standard"), ("gemma2", "standard"), ("phi3", "standard"),
                  ("llama", "ort-gqa"), ("gemma2", "ort-gqa"), ("glm4_moe", "ort-gqa"), ("deepseek_v3", "ort-gqa"),
                  ("qwen3_next", "ort-gqa"), ("qwen3_5", "standard")]  # recurrent states


def drafter_name(spec: dict) -> str:
    return spec.get("name", spec["kind"])


def lossless_drafters(arch: str) -> tuple[str, ...]:
    """The drafters of ``arch``'s lossless builds. The draft model is a tiny llama whatever the
    target, and the runtime drives it the same way for every target architecture: it runs
    beside llama targets (both attention kinds). The int4 copy of the target itself (and its
    catchup graph) is of the target's architecture: every pair has it, and the n-gram drafter."""
    names = [drafter_name(d) for d in ALL_DRAFTERS]
    return tuple(names) if arch == "llama" else tuple(n for n in names if n != "draft-model")


# tiny_recipe's keyword defaults: two requests that differ only by spelling a default out
# (attention="standard", head_dim=None, ...) are the same build.
_RECIPE_DEFAULTS = {name: p.default for name, p in inspect.signature(tiny_recipe).parameters.items()
                    if p.kind is p.KEYWORD_ONLY and name not in ("drafters", "name")}


class TinyEngines:
    """Builds tiny engine directories on demand, once per run per configuration.

    ``root`` is shared by every pytest-xdist worker of the run (shared_root): a configuration's
    directory is named by its settings and built under a file lock, so the worker that asks
    first builds it and the others wait for it and read it."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[tuple, Path] = {}
        self._recipes: dict[Path, Path] = {}

    def get(self, arch: str = "llama", *, drafters: bool | tuple[str, ...] = True, **shape) -> Path:
        """``drafters``: all of ALL_DRAFTERS, none, or those named. ``shape`` holds tiny_recipe's
        keyword arguments (max_seq_len, attention, ...)."""
        names = tuple(drafter_name(d) for d in ALL_DRAFTERS if drafters is True or
                      (drafters and drafter_name(d) in drafters))
        settings = {k: v for k, v in {**_RECIPE_DEFAULTS, **shape}.items() if v is not None}
        key = (arch, names, tuple(sorted(settings.items())))
        if key not in self._built:
            which = "all" if len(names) == len(ALL_DRAFTERS) else ".".join(names) or "target"
            name = f"{arch}-{which}-{hashlib.sha256(repr(key).encode()).hexdigest()[:10]}"
            out, recipe = self.root / name, self.root / f"{name}.yaml"
            with FileLock(self.root / f"{name}.lock"):
                if not (out / "manifest.json").exists():  # build() swaps a whole directory in
                    from specexport.exporter.builder import build
                    from specexport.progress import Reporter

                    tiny_recipe(recipe, arch, name=name,
                                drafters=[d for d in ALL_DRAFTERS if drafter_name(d) in names], **shape)
                    # A draft model must share the target's tokenizer: the byte tokenizer always does.
                    build(recipe, out, False, Reporter(quiet=True))
            self._built[key] = out
            self._recipes[out] = recipe
        return self._built[key]

    def recipe(self, engines: Path) -> Path:
        """The recipe file a directory from ``get`` was built from."""
        return self._recipes[engines]

    def for_arch(self, arch: str, attention: str) -> Path:
        """The one build of ``arch`` with ``attention`` that parity and losslessness tests share:
        TINY_SHAPE, with lossless_drafters(arch) for LOSSLESS_PAIRS and target-only otherwise."""
        gemma = {"head_dim": 16} if arch.startswith("gemma") else {}  # the default, spelled out for Gemma
        drafters = lossless_drafters(arch) if (arch, attention) in LOSSLESS_PAIRS else False
        return self.get(arch, drafters=drafters, attention=attention, **gemma, **TINY_SHAPE)


def shared_root(tmp_path_factory, worker_id: str, name: str) -> Path:
    """A folder of this run that every pytest-xdist worker shares (the run's base temporary
    folder holds one per worker), or the process's own when the run is not distributed."""
    if worker_id == "master":
        return tmp_path_factory.mktemp(name)
    folder = tmp_path_factory.getbasetemp().parent / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory, worker_id) -> TinyEngines:
    return TinyEngines(shared_root(tmp_path_factory, worker_id, "tiny-engines"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_engines) -> Path:
    """The shared tiny llama build: standard attention, TINY_SHAPE, every drafter of ALL_DRAFTERS."""
    return tiny_engines.get("llama", **TINY_SHAPE)


@pytest.fixture(scope="session")
def batched_engines(tiny_engines) -> Path:
    """The tiny ort-gqa build with batch sizes 1, 2 and 4 (every drafter but the heads) that the
    batched graph, loop and schedule tests share."""
    return tiny_engines.get("llama", drafters=("ngram", "quantized-self", "draft-model"), attention="ort-gqa",
                            batch=(1, 2, 4), **TINY_SHAPE)


@pytest.fixture(scope="session")
def batched_hybrid(tiny_engines) -> Path:
    """A tiny Qwen3.5 (linear-attention layers beside attention ones: a recurrent state per row)
    built with batch sizes 1 and 4, standard attention (append graphs), the n-gram and int4
    drafters: the batched hybrid graph, loop and losslessness tests share it."""
    return tiny_engines.get("qwen3_5", drafters=("ngram", "quantized-self"), batch=(1, 4), **TINY_SHAPE)


@pytest.fixture(scope="session")
def batched_hybrid_in_place(tiny_engines) -> Path:
    """A tiny Qwen3-Next with batch sizes 1 and 4 and ort-gqa attention (the K/V written in place
    beside each row's recurrent state), the n-gram and int4 drafters."""
    return tiny_engines.get("qwen3_next", drafters=("ngram", "quantized-self"), attention="ort-gqa", batch=(1, 4),
                            **TINY_SHAPE)


# The target's twin with its weights scaled by 0.9 (same seed, init_std 0.45 against 0.5): its
# drafts are mostly accepted, and now and then rejected after several were.
NEAR_COPY = {"kind": "model", "name": "near-copy",
             "model": {"source": "tiny", "arch": "llama", "seed": 0, "init_std": 0.45}}


@pytest.fixture(scope="session")
def near_copy_engines(tmp_path_factory, worker_id) -> Path:
    """The tiny llama (ort-gqa) with NEAR_COPY as its draft model, built once per run: the
    sampling test (tests/runtime/test_pipeline.py) and the draft model's E[L] floor
    (tests/runtime/test_drafter_acceptance.py) share it."""
    root = shared_root(tmp_path_factory, worker_id, "near-copy")
    with FileLock(root / "build.lock"):
        if not (root / "engines" / "manifest.json").exists():  # build() swaps a whole directory in
            from specexport.exporter.builder import build
            from specexport.progress import Reporter

            recipe = tiny_recipe(root / "r.yaml", "llama", name="near-copy", drafters=[NEAR_COPY], max_seq_len=64,
                                 prefill_chunk=16, max_draft=4, attention="ort-gqa")
            build(recipe, root / "engines", False, Reporter(quiet=True))
    return root / "engines"
