"""Tuned costs: every graph's time re-measured on the machine where the engines run.

The build measures each graph's cost (``EngineEntry.cost_ms``) on the build machine; the
runner's choice of engine sizes and the adaptive depth read those costs. ``specexport tune
ENGINE_DIR`` measures them again here, every model's graphs (probes included, so the verify
cost curve too) in one interleaved schedule (runner.time_rounds: medians, after a check that
the rounds agree, runtime/timing_noise.py), and writes
``costs.json`` beside the manifest (or in the per-user cache: runtime/sidecar.py) with the
machine it was measured on. ``load`` prefers them; a file measured for another manifest is
ignored with a warning.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path

from specexport.backends import BACKENDS
from specexport.contract import MANIFEST, EngineEntry, Manifest, Role, sha256_of
from specexport.errors import BadInput
from specexport.runtime import sidecar
from specexport.runtime.runner import FillTiming, time_rounds
from specexport.runtime.timing_noise import check_noise, labelled, medians

COSTS = "costs.json"
TREES = "target trees"  # the schedule's name for the target's tree verify graphs
COSTS_FORMAT = 1
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TunedCosts:
    engines: dict[str, dict[str, float]]  # backend -> engine name -> ms of one run
    host: str
    measured: str  # ISO date and time (UTC)
    path: Path

    def ms(self, entry: EngineEntry) -> float | None:
        return self.engines.get(entry.backend, {}).get(entry.name)

    @property
    def label(self) -> str:
        return f"tuned ({self.host}, {self.measured})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(*dists: str) -> str | None:
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine(threads: int | None) -> dict:
    """What the costs depend on besides the graphs."""
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,  # the intra-op threads asked for (None: onnxruntime's default)
        **{b.name: _version(*b.dists) for b in BACKENDS.values()},
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def fill_key(model: str) -> str:
    """The timing schedule's name for ``model``'s fill entries."""
    return f"{model} fill"


def tune(pipe, rounds: int = 9, accept_noise: bool = False) -> dict:
    """Time every graph of every model the pipeline can run, interleaved; write costs.json and
    return what was written (with ``written_to``). Rounds of one graph that spread more than
    timing_noise.NOISE_LIMIT raise NoisyTimings and write nothing, unless ``accept_noise``."""
    runners = {}
    for model in pipe.manifest.models:
        try:
            pipe.backend_of(model)
        except BadInput:  # a model without engines for this backend (nor the fallback)
            continue
        runner = pipe.runner(model)
        runners[model] = (runner, runner.sizes)
        if runner.fill_sizes:  # a drafter's fill entries (Role.FILL), timed as the build times them
            runners[fill_key(model)] = (FillTiming(runner), runner.fill_sizes)
    # the target's tree verify graphs, every (batch, rows): tree rounds size trees by them
    trees = pipe.tree_verifier(pipe.batched_target())
    if trees is not None:
        runners[TREES] = (trees, sorted(trees.engines))
    samples = time_rounds(runners, rounds)

    def label(model: str, key) -> str:  # the engine's name (a tree graph: its (batch, rows))
        return f"target tree {key}" if model == TREES else runners[model][0].engine_at(key)

    fill_keys = {fill_key(m) for m in pipe.manifest.models}
    noisy = check_noise(labelled(samples, label), rounds, accept_noise)  # before anything is written
    times = medians(samples)
    measured: dict[str, dict[str, float]] = {}
    for model in (m for m in runners if m != TREES and m not in fill_keys):
        backend = pipe.backend_of(model)
        for entry in pipe.manifest.engines_of(model, backend):
            timed = times[fill_key(model) if entry.role is Role.FILL else model]
            measured.setdefault(backend, {})[entry.name] = round(timed[entry.tokens] * 1e3, 3)
    if trees is not None:
        backend = pipe.backend_of("target")
        for entry in pipe.manifest.engines_of("target", backend, batch=None, tree=True):
            if (entry.batch, entry.tokens) in times[TREES]:
                measured.setdefault(backend, {})[entry.name] = round(times[TREES][(entry.batch, entry.tokens)] * 1e3, 3)
    root = pipe.manifest.root
    manifest_sha = sha256_of(root / MANIFEST)
    previous = sidecar.read_json(root, COSTS)
    engines = {}
    if previous is not None and previous[0].get("manifest_sha256") == manifest_sha:
        engines = dict(previous[0].get("engines") or {})  # keep other backends' measurements
    engines.update(measured)
    target = times["target"]
    data = {
        "format": COSTS_FORMAT,
        "manifest_sha256": manifest_sha,
        "engine_dir": sidecar.real_root(root),
        "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(pipe.options.threads),
        "rounds": rounds,
        # entries written although their rounds spread past the limit (--accept-noise)
        "noisy": {e.what: round(e.spread, 3) for e in noisy},
        "engines": engines,
        # the verify cost curve, for reading: the target's time per pass against its tokens
        "curve": [{"tokens": t, "ms": round(s * 1e3, 3), "relative": round(s / target[min(target)], 3)}
                  for t, s in sorted(target.items())],
    }
    where = sidecar.write_json(root, COSTS, data)
    return {**data, "written_to": str(where) if where else None}


def load_tuned(manifest: Manifest) -> TunedCosts | None:
    """The tuned costs of this directory, or None (none, or measured for another manifest:
    then with a warning, and the build's costs apply)."""
    found = sidecar.read_json(manifest.root, COSTS)
    if found is None:
        return None
    data, path = found
    if data.get("format") != COSTS_FORMAT or data.get("manifest_sha256") != sha256_of(manifest.root / MANIFEST):
        _log.warning("%s: measured for another manifest than %s's; using the build's costs "
                     "(run specexport tune %s again)", path, manifest.root, manifest.root)
        return None
    engines = data.get("engines")
    if not isinstance(engines, dict):
        _log.warning("%s: no engine costs in it; using the build's costs", path)
        return None
    host = (data.get("machine") or {}).get("hostname", "?")
    return TunedCosts({b: {n: float(ms) for n, ms in e.items()} for b, e in engines.items()},
                      str(host), str(data.get("measured", "?")), path)


def costs_in_use(engine_dir: str | Path) -> dict:
    """The plan and, per engine, the build's cost, the tuned one and the one the runtime uses
    (``specexport plan ENGINE_DIR``); opens no session."""
    manifest = Manifest.load(engine_dir)
    tuned = load_tuned(manifest)
    rows = []
    for entry in sorted(manifest.engines, key=lambda e: (e.backend, e.model, e.tokens)):
        here = tuned.ms(entry) if tuned is not None else None
        rows.append({"engine": entry.name, "backend": entry.backend, "role": entry.role.value,
                     "tokens": entry.tokens, "build_ms": entry.cost_ms, "tuned_ms": here,
                     "used_ms": here if here is not None else entry.cost_ms})
    return {"engine_dir": str(engine_dir), "plan": manifest.plan,
            "costs": tuned.label if tuned is not None else "build",
            "costs_file": str(tuned.path) if tuned is not None else None, "engines": rows}
