"""scripts/gpu_check.sh and its Python parts (scripts/gpu_check.py, specexport/bench/gpu_targets.py,
specexport/bench/device.py) on the CPU: the targets and the report on a fixture result, the GPU
recipe, the prompt subset, the peers' placement; the whole dry run is marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specexport.bench import gpu_targets
from specexport.bench.device import curve_from_file, default_peers, peer_device
from specexport.bench.peers import GPU_PEERS, PeerDevice, draft_model_source, make_peers
from specexport.errors import BadInput
from tests.conftest import REPO, TINY_SHAPE
from tests.gpu import needs_cuda_ort
from tests.scripts import load_script

TINY = {"source": "tiny", "arch": "llama", "seed": 0, "hidden_size": 64, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


gpu_check = load_script("gpu_check")


def bench_result(tile_relative=1.3, code_speedup=2.4, math_speedup=2.1, lossless=True, peer_relative=0.1) -> dict:
    """A bench.json as `bench --device cuda` writes it (the keys the targets read)."""
    categories = [{"drafter": d, "category": c, "prompts": 1, "tokens_per_s": 500.0 * s, "speedup": s,
                   "matches_baseline": lossless if d != "none" else True}
                  for c, best in (("grounded-code", code_speedup), ("math", math_speedup), ("chat", 1.2))
                  for d, s in (("none", 1.0), ("ngram", best), ("eagle3", best * 0.9))]
    results = [{"drafter": r["drafter"], "prompt_id": r["category"], "matches_baseline": r["matches_baseline"]}
               for r in categories]
    return {
        "settings": {"device": "cuda", "max_new_tokens": 64, "repeats": 2, "threads": 8,
                     "drafters": ["none", "ngram", "eagle3"]},
        "categories": categories,
        "results": results,
        "cost_curve": [{"tokens": 1, "ms": 2.0, "relative": 1.0}, {"tokens": 8, "ms": 2.2, "relative": 1.1},
                       {"tokens": 42, "ms": 2.0 * tile_relative, "relative": tile_relative}],
        "cost_curve_cpu": {"source": "file cpu.json", "threads": 2, "curve": [{"tokens": 1, "ms": 20.0, "relative": 1.0},
                                                                          {"tokens": 42, "ms": 85.0, "relative": 4.25}]},
        "tile_point": {"tokens": 42, "group_size": 3, "measured": True},
        "peers": [{"peer": "transformers-greedy", "prompt_id": c, "relative_to_baseline": peer_relative,
                   "settings": {"dtype": "float16"}, "matches_own_plain": None}
                  for c in ("grounded-code", "math", "chat")]
                 + [{"peer": "transformers-prompt-lookup", "prompt_id": "math", "relative_to_baseline": 0.2,
                     "settings": {}, "matches_own_plain": True}],
        "peers_skipped": [{"peer": "transformers-assistant", "skipped": "the recipe has no draft model"}],
    }


def by_name(targets: list[dict]) -> dict[str, dict]:
    return {t["name"].split(" >= ")[0].split(" <= ")[0]: t for t in targets}


def test_the_targets_hold_on_a_result_that_meets_them():
    targets = gpu_targets.check(bench_result())
    assert [t["ok"] for t in targets] == [True] * 5
    named = by_name(targets)
    assert named["target alone"]["value"] == 10.0  # 1 / relative_to_baseline 0.1
    assert named["verify pass of 42 tokens"]["value"] == 1.3
    assert named["best drafter"]["detail"].startswith("ngram")


@pytest.mark.parametrize("broken, name", [
    (dict(peer_relative=0.25), "target alone"),  # only 4x transformers
    (dict(tile_relative=1.6), "verify pass of 42 tokens"),
    (dict(lossless=False), "every output equal to the target alone's"),
])
def test_each_target_fails_where_the_result_misses_it(broken, name):
    targets = by_name(gpu_targets.check(bench_result(**broken)))
    assert targets[name]["ok"] is False
    assert sum(t["ok"] is False for t in targets.values()) == 1


def test_the_best_drafter_is_checked_per_category():
    targets = gpu_targets.check(bench_result(math_speedup=1.5))
    math = next(t for t in targets if t["name"].endswith("on math"))
    code = next(t for t in targets if t["name"].endswith("on grounded-code"))
    assert (math["ok"], math["value"], code["ok"]) == (False, 1.5, True)


def test_a_target_without_its_measurement_says_why():
    result = bench_result()
    result["cost_curve"] = result["cost_curve"][:2]  # no 42-token engine
    result["peers"] = []
    result["peers_skipped"] = [{"peer": "transformers-greedy", "skipped": "torch sees no CUDA device"}]
    named = by_name(gpu_targets.check(result))
    assert named["verify pass of 42 tokens"]["ok"] is None and "probe_tokens" in named["verify pass of 42 tokens"]["detail"]
    assert named["target alone"]["ok"] is None and named["target alone"]["detail"] == "torch sees no CUDA device"


def write_run(out: Path, result: dict | None, steps: list[dict]) -> None:
    """What gpu_check.sh's steps leave in OUT: env.json, steps.jsonl, logs/, bench/bench.json."""
    (out / "logs").mkdir(parents=True)
    (out / "env.json").write_text(json.dumps({
        "python": "3.12.3", "gpu": {"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"},
        "onnxruntime": {"version": "1.31.1", "dist": ["onnxruntime_gpu-1.31.1.dist-info"],
                        "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]},
        "torch": {"version": "2.11.0+cu130"}, "problems": []}))
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / "logs" / "pytest.log").write_text("....\n======= 3 passed, 2 skipped, 1470 deselected in 9.1s =======\n")
    if result is not None:
        (out / "bench").mkdir()
        (out / "bench" / "bench.json").write_text(json.dumps(result))


STEPS = [{"step": s, "status": "ok", "rc": 0, "seconds": 1.5, "limit": 60, "log": f"logs/{s}.log"}
         for s in ("install", "env", "recipe", "build", "pytest", "prompts", "bench")]


def test_the_report_names_the_machine_the_command_and_the_targets(tmp_path):
    write_run(tmp_path, bench_result(), STEPS)
    report = gpu_check.write_report(tmp_path, "scripts/gpu_check.sh --wheel ort.whl", dry_run=False)
    md = (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    for text in ("NVIDIA H100 80GB HBM3", "driver 580.159.04", "1.31.1", "onnxruntime_gpu-1.31.1.dist-info",
                 "`scripts/gpu_check.sh --wheel ort.whl`", "3 passed, 2 skipped", "file cpu.json", "| cpu | 1.00 |"):
        assert text in md, text
    assert md.count("| yes |") >= 5
    assert report["seconds"] == 10.5 and gpu_check.report_exit(report) == 0


def test_a_failed_step_still_gives_a_report_and_a_failing_exit(tmp_path):
    steps = STEPS[:3] + [{**STEPS[3], "status": "timeout", "rc": 124}]
    write_run(tmp_path, None, steps)
    report = gpu_check.write_report(tmp_path, "scripts/gpu_check.sh", dry_run=False)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| build | timeout |" in md and "no bench result" in md
    assert report["targets"] == [] and gpu_check.report_exit(report) == 1


def test_outputs_that_differ_fail_the_check(tmp_path):
    write_run(tmp_path, bench_result(lossless=False), STEPS)
    assert gpu_check.report_exit(gpu_check.build_report(tmp_path, "x", dry_run=False)) == 1


def test_the_gpu_recipe_is_the_default_at_batch_1_with_absolute_paths(tmp_path):
    data = gpu_check.gpu_recipe(REPO / "recipes" / "smollm2-135m.yaml", dry_run=False, gguf=tmp_path / "m.gguf")
    assert data["shapes"]["batch"] == 1 and data["shapes"]["max_seq_len"] >= 1024
    assert data["precision"] == "fp16" and "calibration" not in data["draft"]
    assert data["target"] == {"source": "gguf", "path": str((tmp_path / "m.gguf").resolve())}
    eagle = next(d for d in data["drafters"] if d["kind"] == "eagle3")
    assert Path(eagle["path"]).is_absolute() and Path(eagle["path"]).is_dir()
    assert data["draft"]["probe_tokens"][-1] == 42  # the tile rule's 1+D is on the curve
    from specexport.exporter.recipe import Recipe

    Recipe.model_validate(data)  # a recipe the build takes
    tiny = gpu_check.gpu_recipe(REPO / "recipes" / "tiny-llama.yaml", dry_run=True, gguf=tmp_path / "m.gguf")
    assert tiny["target"]["source"] == "tiny" and "precision" not in tiny  # a dry run keeps the CPU's settings


def test_the_prompt_subset_takes_the_first_of_each_category():
    lines = (REPO / "bench" / "prompts" / "dev.jsonl").read_text().splitlines()
    chosen = [json.loads(line) for line in gpu_check.prompt_subset(lines, ("grounded-code", "math"), 1)]
    assert [p["category"] for p in chosen] == ["grounded-code", "math"]


def test_the_gpu_bench_places_the_transformers_peers_on_the_gpu_in_fp16():
    assert peer_device("cuda") == PeerDevice("cuda", "float16") and peer_device("cpu").is_default
    assert default_peers("cpu") == "" and default_peers("cuda").split(",") == list(GPU_PEERS)
    assert default_peers("cuda", batched=True) == "transformers-greedy"
    recipe = {"drafters": [{"kind": "ngram"}, {"kind": "model", "name": "d", "model": TINY}]}
    assert draft_model_source(recipe) == TINY and draft_model_source({"drafters": [{"kind": "ngram"}]}) is None


def test_off_the_cpu_the_cpu_peers_are_skipped_and_a_missing_gpu_is_named(tmp_path):
    names = ["transformers-greedy", "ort-genai", "llama-cpp"]
    made, skipped = make_peers(TINY, tmp_path, names, 1, tmp_path / "cache", PeerDevice("cuda", "float16"))
    reasons = {s["peer"]: s["skipped"] for s in skipped}
    assert "runs with bench --device cpu" in reasons["ort-genai"] and "runs with bench --device cpu" in reasons["llama-cpp"]
    import torch

    if not torch.cuda.is_available():
        assert made == [] and "no CUDA device" in reasons["transformers-greedy"]


def test_the_cpu_curve_comes_from_a_cpu_bench_file(tmp_path):
    report = REPO / "bench" / "reports" / "2026-12-01-bench" / "bench.json"
    curve = curve_from_file(report)
    assert curve["source"] == f"file {report}" and [c["tokens"] for c in curve["curve"]][-2] == 42
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"settings": {"device": "cuda"}, "cost_curve": curve["curve"]}))
    with pytest.raises(BadInput, match="give a CPU run's bench.json"):
        curve_from_file(gpu)
    with pytest.raises(BadInput, match="not a bench.json"):
        curve_from_file(tmp_path / "none.json")


def test_the_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


@needs_cuda_ort
def test_bench_on_cuda_runs_the_fp16_transformers_peers_beside_our_engines(tiny_engines, tmp_path):
    """bench --device cuda on the tiny build: our engines on the CUDA provider, every drafter's
    output the target alone's, the three transformers peers in fp16 on the GPU, the CPU curve beside."""
    from specexport.bench.harness import BenchOptions, run_bench
    from specexport.progress import Reporter

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": c, "category": c, "prompt": f"def {c}(a, b):\n    return a + b\n"}) + "\n"
                               for c in ("grounded-code", "math")))
    options = BenchOptions(prompts=prompts, max_new_tokens=12, repeats=1, device="cuda", peers=list(GPU_PEERS),
                           cost_repeats=3)
    result = run_bench(tiny_engines.get("llama", **TINY_SHAPE), options, Reporter(quiet=True))
    assert result["settings"]["device"] == "cuda"
    assert all(r["matches_baseline"] for r in result["results"])
    assert {p["peer"] for p in result["peers"]} == set(GPU_PEERS), result["peers_skipped"]
    assert all(p["settings"]["dtype"] == "float16" and p["settings"]["device"].startswith("cuda")
               for p in result["peers"])
    assert result["cost_curve_cpu"]["curve"] and result["cost_curve_cpu"]["source"].startswith("measured")
    assert [t["ok"] for t in gpu_targets.check(result)][-1] is True  # outputs equal


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh --dry-run: install (a venv over this python), env, recipe (tiny), build,
    pytest -m gpu, prompts, bench on the CPU provider with the three transformers peers, the target
    alone with CUDA graphs on and off (on the CPU provider: the same runs), report."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CARRY": str(tmp_path / "no-carry"), "TOTAL_S": "400"}
    done = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["install", "env", "recipe", "build", "pytest", "prompts", "bench",
                                                    "graphs"]
    assert all(s["status"] == "ok" for s in report["steps"])
    assert set(report["cuda_graphs"]) == {"on", "off"} and all(v > 0 for v in report["cuda_graphs"].values())
    assert report["bench"]["peers"] == sorted(GPU_PEERS)
    assert by_name(report["targets"])["every output equal to the target alone's"]["ok"] is True


def test_the_provider_smoke_test_runs_on_the_cpu_and_says_when_a_provider_is_not_kept():
    assert gpu_check.provider_smoke("cpu")["ok"] is True
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert gpu_check.provider_smoke("cuda")["ok"] is False  # onnxruntime fell back to the CPU


def test_the_cpu_curve_is_measured_over_the_same_directory_or_says_why_not(tiny_engines, tmp_path):
    from specexport.bench.device import curve_measured

    curve = curve_measured(tiny_engines.get("llama", **TINY_SHAPE), threads=1, repeats=2)
    assert curve["source"].startswith("measured") and curve["curve"][0]["tokens"] == 1
    assert curve["curve"][0]["relative"] == 1.0 and all(c["ms"] > 0 for c in curve["curve"])
    failed = curve_measured(tmp_path / "no-engines", threads=1, repeats=2)
    assert failed["source"] == "not measured" and failed["curve"] == [] and failed["error"]
