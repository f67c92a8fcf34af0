"""The Python steps of scripts/gpu_check.sh: what the machine has, the GPU recipe, the prompt
subset, and the one report (markdown + JSON). The shell script times and bounds each step;
this file only reads and writes files, so the report is written whatever step failed.

    python scripts/gpu_check.py env --out DIR [--device cuda]
    python scripts/gpu_check.py recipe --base recipes/smollm2-135m.yaml --out DIR/gpu.yaml [--dry-run] [--gguf F]
    python scripts/gpu_check.py prompts --src bench/prompts/dev.jsonl --out DIR/prompts.jsonl
    python scripts/gpu_check.py report --out DIR --command "scripts/gpu_check.sh ..."
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the extras whose packages the check needs on the machine: the runtime's own, and the exporter's
# (build traces with torch and validates against transformers)
NEEDED_EXTRAS = ("export",)
# what the bench and pytest need besides (the device image has them; checked all the same)
ALSO_NEEDED = ("pytest",)
PROMPT_CATEGORIES = ("grounded-code", "math", "chat")  # the targets' categories, and a plain chat
PROMPTS_PER_CATEGORY = 2
MIN_SEQ_LEN = 1024


# --- env ---------------------------------------------------------------------------------------


def requirements() -> list[str]:
    """specexport's requirements and those of NEEDED_EXTRAS, from pyproject.toml (self-references out)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in NEEDED_EXTRAS:
        wanted += project["optional-dependencies"][extra]
    return [r for r in dict.fromkeys(wanted + list(ALSO_NEEDED)) if not r.startswith("specexport")]


def missing(reqs: list[str], deep: bool = False) -> list[str]:
    """Each requirement (``deep``: and each of theirs in turn) not installed or installed at a
    version outside its range: 'name (why)' (pip check would list the whole image's)."""
    from packaging.requirements import Requirement

    out: list[str] = []
    todo, seen = list(reqs), set()
    while todo:
        req = Requirement(todo.pop(0))
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = (req.name.lower().replace("_", "-"), str(req.specifier))
        if key in seen:
            continue
        seen.add(key)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{req.name} (not installed; wants {req.specifier or 'any'})")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} (has {version}; wants {req.specifier})")
        if deep:
            todo += importlib.metadata.requires(req.name) or []
    return out


def gpu_info() -> dict:
    """nvidia-smi's name, driver and memory of the first GPU (empty without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
    first = (done.stdout.strip().splitlines() or [""])[0]
    fields = [f.strip() for f in first.split(",")]
    return dict(zip(("name", "driver", "memory", "compute_cap"), fields)) if len(fields) == 4 else {"raw": first}


def onnxruntime_info() -> dict:
    """The onnxruntime that imports (the GPU wheel shadows the CPU one through PYTHONPATH): its
    distribution, version, file and providers."""
    if importlib.util.find_spec("onnxruntime") is None:
        return {"error": "onnxruntime is not installed"}
    try:
        import onnxruntime as ort
    except Exception as err:  # a GPU wheel missing its CUDA libraries fails here
        return {"error": f"{type(err).__name__}: {err}"}
    origin = Path(ort.__file__).resolve().parent.parent
    dists = [d.name for d in origin.glob("onnxruntime*.dist-info") if not d.name.startswith("onnxruntime_genai")]
    return {"version": ort.__version__, "file": ort.__file__, "dist": dists,
            "providers": ort.get_available_providers(), "device": ort.get_device()}


def provider_smoke(device: str) -> dict:
    """One Add node run in a session on ``device``'s provider: whether the session kept that
    provider (onnxruntime falls back to the CPU when the CUDA libraries do not load) and the result."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "smoke", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 9)  # what older onnxruntime builds read
    try:
        from specexport.runtime.ort_engine import SHARED_POOL, session_options

        # on the process's one thread pool, as every session of ours: once it exists, a session
        # with threads of its own is refused
        so = session_options(ort, SHARED_POOL.size or 1)
        session = ort.InferenceSession(model.SerializeToString(), so,
                                       providers=list(dict.fromkeys([provider, "CPUExecutionProvider"])))
        y = session.run(["y"], {"x": np.arange(4, dtype=np.float32)})[0]
    except Exception as err:
        return {"provider": provider, "ok": False, "error": f"{type(err).__name__}: {err}"}
    kept = session.get_providers()[0] == provider
    return {"provider": provider, "ok": bool(kept and np.array_equal(y, [0, 2, 4, 6])), "session": session.get_providers()}


def torch_info() -> dict:
    try:
        import torch
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    cuda = torch.cuda.is_available()
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
            "device": torch.cuda.get_device_name(0) if cuda else None}


def env(out: Path, device: str) -> int:
    """Write env.json; exit 1 when the machine lacks what the check needs, naming each."""
    info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "gpu": gpu_info(), "onnxruntime": onnxruntime_info(), "torch": torch_info(),
            "missing": missing(requirements())}
    # what our requirements need in turn: reported, not refused (an image's torch may want a
    # newer setuptools than it has, and run all the same)
    info["warnings"] = [m for m in missing(requirements(), deep=True) if m not in info["missing"]]
    try:
        import specexport

        info["specexport"] = {"version": specexport.__version__, "file": specexport.__file__}
    except Exception as err:
        info["specexport"] = {"error": f"{type(err).__name__}: {err}"}
    info["smoke"] = provider_smoke(device) if "error" not in info["onnxruntime"] else {"ok": False}
    problems = list(info["missing"])
    if not info["smoke"]["ok"]:
        problems.append(f"a one-node session on {device} did not run there: {info['smoke']}")
    if device == "cuda" and "CUDAExecutionProvider" not in info["onnxruntime"].get("providers", []):
        problems.append(f"onnxruntime {info['onnxruntime'].get('version', '?')} has no CUDAExecutionProvider "
                        f"({info['onnxruntime'].get('error') or 'the CPU wheel: install the onnxruntime-gpu wheel'})")
    if device == "cuda" and not info["torch"].get("cuda_available"):
        problems.append("torch sees no CUDA device (the transformers peers run there)")
    info["problems"] = problems
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: info[k] for k in ("python", "gpu", "onnxruntime", "torch", "smoke")}, indent=1))
    for problem in problems:
        print(f"gpu_check: missing: {problem}", file=sys.stderr)
    for warning in info["warnings"]:
        print(f"gpu_check: a requirement's requirement: {warning}", file=sys.stderr)
    return 1 if problems else 0


# --- recipe ------------------------------------------------------------------------------------


def gpu_settings(dry_run: bool) -> dict:
    """The recipe settings of the GPU build (the dry run: none, the recipe's CPU ones):
    ``device: cuda`` picks fp16 ort-gqa graphs whose every node runs on the CUDA provider
    (exporter/gpu_build.py)."""
    return {} if dry_run else {"precision": "fp16", "device": "cuda"}


def _absolute(path: str, base: Path) -> str:
    return str(path if Path(path).is_absolute() else (base / path).resolve())


def gpu_recipe(base: Path, dry_run: bool, gguf: Path | None) -> dict:
    """The base recipe for this check: batch 1 only (the bench runs one sequence), paths made
    absolute (it is written elsewhere), the CPU's calibration dropped (it measured a CPU's D),
    the GPU's settings; ``gguf``: the target's GGUF file from a path instead of its package."""
    import yaml

    data = yaml.safe_load(base.read_text())
    root = base.resolve().parent
    for drafter in data.get("drafters", []):
        if drafter.get("path"):
            drafter["path"] = _absolute(drafter["path"], root)
        model = drafter.get("model") or {}
        if model.get("path"):
            model["path"] = _absolute(model["path"], root)
    if data["target"].get("path"):
        data["target"]["path"] = _absolute(data["target"]["path"], root)
    if gguf is not None and data["target"].get("source") == "gguf":  # the same file, carried
        data["target"] = {"source": "gguf", "path": str(gguf.resolve())}
    (data.get("draft") or {}).pop("calibration", None)
    shapes = data.setdefault("shapes", {})
    shapes["batch"] = 1
    # the bench's prompts (bench/prompts/dev.jsonl: up to about 900 tokens) and their new tokens fit
    shapes["max_seq_len"] = max(shapes.get("max_seq_len", 0), MIN_SEQ_LEN)
    data.update(name=f"{data['name']}-{'dry' if dry_run else 'gpu'}", **gpu_settings(dry_run))
    return data


def recipe(base: Path, out: Path, dry_run: bool, gguf: Path | None) -> int:
    import yaml

    data = gpu_recipe(base, dry_run, gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out}: precision {data.get('precision', 'fp32')}, device {data.get('device', '(no field)')}, "
          f"attention {data.get('attention', 'standard')}, target {data['target']}")
    return 0


# --- prompts -----------------------------------------------------------------------------------


def prompt_subset(lines: list[str], categories: tuple[str, ...], per_category: int) -> list[str]:
    """The first ``per_category`` prompts of each category, in the file's order."""
    taken: dict[str, int] = {}
    out = []
    for line in lines:
        if not line.strip():
            continue
        category = json.loads(line).get("category")
        if category in categories and taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            out.append(line)
    return out


def prompts(src: Path, out: Path, categories: tuple[str, ...], per_category: int) -> int:
    chosen = prompt_subset(src.read_text().splitlines(), categories, per_category)
    if not chosen:
        print(f"gpu_check: {src}: no prompt of {', '.join(categories)}", file=sys.stderr)
        return 1
    out.write_text("\n".join(chosen) + "\n")
    print(f"wrote {out}: {len(chosen)} prompts")
    return 0


# --- report ------------------------------------------------------------------------------------


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _pytest_summary(log: Path) -> str | None:
    """pytest's closing line ('3 passed, 2 skipped in 4.1s'), from the step's log."""
    try:
        lines = [line.strip("= ").strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return None
    closing = [line for line in lines if " in " in line and any(w in line for w in ("passed", "failed", "skipped",
                                                                                    "deselected", "error"))]
    return closing[-1] if closing else None


def build_report(out: Path, command: str, dry_run: bool) -> dict:
    """Everything the check found, from the files its steps left in ``out``."""
    from specexport.bench.gpu_targets import check

    info = _read_json(out / "env.json") or {}
    steps = _steps(out / "steps.jsonl")
    bench = _read_json(out / "bench" / "bench.json")
    ort = info.get("onnxruntime") or {}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": dry_run,
        "command": command,
        "gpu": (info.get("gpu") or {}).get("name") or ("none (dry run: CPU provider)" if dry_run else "none found"),
        "driver": (info.get("gpu") or {}).get("driver"),
        "onnxruntime": {k: ort.get(k) for k in ("version", "dist", "providers", "error") if ort.get(k) is not None},
        "torch": info.get("torch"),
        "python": info.get("python"),
        "missing": info.get("problems", info.get("missing", [])),
        "warnings": info.get("warnings", []),
        "steps": steps,
        "seconds": round(sum(s.get("seconds", 0.0) for s in steps), 1),
        "pytest": _pytest_summary(out / "logs" / "pytest.log"),
        "targets": check(bench) if bench else [],
        "bench": None,
        # the target alone's tokens/s with CUDA graphs on and off (the graphs step)
        "cuda_graphs": {way: (_read_json(out / f"graphs_{way}.json") or {}).get("stats", {}).get("tokens_per_s")
                        for way in ("on", "off") if (out / f"graphs_{way}.json").exists()},
    }
    if bench:
        report["bench"] = {
            "device": bench["settings"].get("device", "cpu"),
            "settings": {k: bench["settings"][k] for k in ("max_new_tokens", "repeats", "threads", "drafters")},
            "categories": [{k: r[k] for k in ("drafter", "category", "tokens_per_s", "speedup", "matches_baseline")}
                           for r in bench["categories"]],
            "cost_curve": bench["cost_curve"],
            "cost_curve_cpu": bench.get("cost_curve_cpu"),
            "peers": sorted({p["peer"] for p in bench.get("peers", [])}),
            "peers_skipped": bench.get("peers_skipped", []),
        }
    return report


def _fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return format(value, spec) if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    ort = report["onnxruntime"]
    lines = [f"# GPU check{' (dry run on the CPU)' if report['dry_run'] else ''}: {report['date']}", "",
             f"- GPU: {report['gpu']}; driver {report['driver'] or '–'}",
             f"- onnxruntime: {ort.get('version', '–')} ({', '.join(ort.get('dist') or []) or '?'}); "
             f"providers {', '.join(ort.get('providers') or []) or ort.get('error', '–')}",
             f"- torch: {(report['torch'] or {}).get('version', '–')}; python {report['python'] or '–'}",
             f"- command: `{report['command']}`",
             f"- steps took {report['seconds']} s in all"]
    if report["missing"]:
        lines.append(f"- missing on this machine: {'; '.join(report['missing'])}")
    if report["warnings"]:
        lines.append(f"- what our requirements need in turn, not as installed: {'; '.join(report['warnings'])}")
    lines += ["", "## Targets", "", "| target | value | limit | holds | detail |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        holds = {True: "yes", False: "**NO**", None: "not measured"}[t["ok"]]
        lines.append(f"| {t['name']} | {_fmt(t['value'])} | {t['limit']} | {holds} | {t['detail']} |")
    if not report["targets"]:
        lines.append("| (no bench result: see the steps) | | | | |")
    lines += ["", "## Steps", "", "| step | status | seconds | limit s | log |", "|---|---|---|---|---|"]
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {_fmt(s.get('seconds'), '.1f')} | {s.get('limit', '–')} | "
                     f"{s.get('log', '')} |")
    if report["pytest"]:
        lines += ["", f"pytest -m gpu: {report['pytest']}"]
    graphs = report.get("cuda_graphs") or {}
    if graphs:
        lines += ["", "CUDA graphs (the target alone, one prompt): " + ", ".join(
            f"{way} {_fmt(tps, '.1f')} tok/s" for way, tps in graphs.items())]
    bench = report["bench"]
    if bench:
        lines += ["", f"## Bench on {bench['device']} ({bench['settings']['max_new_tokens']} new tokens, "
                  f"{bench['settings']['repeats']} repeats, {bench['settings']['threads']} threads)", "",
                  "| drafter | category | tok/s | speedup | lossless |", "|---|---|---|---|---|"]
        for r in bench["categories"]:
            lines.append(f"| {r['drafter']} | {r['category']} | {_fmt(r['tokens_per_s'], '.1f')} | "
                         f"{_fmt(r['speedup'])}× | {_fmt(r['matches_baseline'])} |")
        lines += ["", f"Peers: {', '.join(bench['peers']) or 'none'}"]
        lines += [f"- {s['peer']}: skipped ({s['skipped']})" for s in bench["peers_skipped"]]
        cpu = bench.get("cost_curve_cpu") or {}
        cpu_rel = {c["tokens"]: c["relative"] for c in cpu.get("curve", [])}
        lines += ["", f"Verify cost curve, relative to one token ({bench['device']}; CPU: {cpu.get('source', '–')}):", "",
                  "| tokens | " + " | ".join(str(c["tokens"]) for c in bench["cost_curve"]) + " |",
                  "|---|" + "---|" * len(bench["cost_curve"]),
                  f"| {bench['device']} | " + " | ".join(f"{c['relative']:.2f}" for c in bench["cost_curve"]) + " |"]
        if cpu_rel:
            lines.append("| cpu | " + " | ".join(_fmt(cpu_rel.get(c["tokens"])) for c in bench["cost_curve"]) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, command: str, dry_run: bool) -> dict:
    report = build_report(out, command, dry_run)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    return report


def report_exit(report: dict) -> int:
    """1 when a step failed or an output differed (a target missed is the report's news, not a failure)."""
    failed = [s for s in report["steps"] if s["status"] != "ok"]
    differ = [t for t in report["targets"] if t["name"].startswith("every output") and t["ok"] is False]
    return 1 if failed or differ or not report["targets"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("env")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("recipe")
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--gguf", type=Path, default=None)
    p = sub.add_parser("prompts")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--categories", default=",".join(PROMPT_CATEGORIES))
    p.add_argument("--per-category", type=int, default=PROMPTS_PER_CATEGORY)
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--command", default="scripts/gpu_check.sh")
    p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "env":
        return env(args.out, args.device)
    if args.what == "recipe":
        return recipe(args.base, args.out, args.dry_run, args.gguf)
    if args.what == "prompts":
        return prompts(args.src, args.out, tuple(args.categories.split(",")), args.per_category)
    report = write_report(args.out, args.command, args.dry_run)
    print(markdown(report))
    return report_exit(report)


if __name__ == "__main__":
    sys.exit(main())
