"""`specexport distill --drafter eagle3` on a tiny target: a seconds-long run must lower the
held-out loss and raise held-out acceptance over the untrained head; its output builds and
decodes losslessly; --resume continues the step count; an interrupt keeps the last checkpoint
and leaves nothing half-written; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import check_one_line, run_cli
from tests.heads.common import SHAPES, build, check_greedy_lossless, check_parity

# small init spread: a target whose next token a one-layer head can learn in seconds
TARGET = {"source": "tiny", "arch": "llama", "num_layers": 4, "init_std": 0.15}
TOPICS = ["the sea", "a red fox", "prime numbers", "bread", "rain", "a small robot", "chess", "the moon",
          "tea", "rivers", "birds", "a lamp", "snow", "clocks", "music", "paper"]
STEPS = 150
SETTINGS = dict(max_new=48, holdout=0.25, warmup=10, batch_tokens=1024, minutes=30.0, eval_minutes=60.0)  # steps, not time, end a run


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill")
    recipe = {"name": "tiny-distill", "target": TARGET, "shapes": SHAPES, "draft": {"max_draft": 3}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) for t in TOPICS]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    data = [{"text": "A lighthouse stands on the rocks; its lamp turns all night."},
            {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]}]
    (root / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    return root


def options(work: Path, out: Path, **changes):
    from specexport.exporter.distill.command import DistillOptions

    settings = {"prompts": [work / "prompts.jsonl"], "data": [work / "data.jsonl"], **SETTINGS, **changes}
    return DistillOptions(recipe=work / "recipe.yaml", drafter="eagle3", out=out, quiet=True, **settings)


def command(*args) -> subprocess.Popen:
    """`specexport distill ARGS --quiet` in a fresh process. One torch thread: on 2 shared cores
    a pool of 2 spin-waits through generation's many tiny ops (minutes instead of seconds)."""
    return subprocess.Popen([sys.executable, "-m", "specexport", "distill", *map(str, args), "--quiet"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_at_a_terminal)


def _ctrl_c_as_at_a_terminal() -> None:
    """A shell starts background jobs (a suite run with `&`) with SIGINT ignored, and a Python
    started that way never raises KeyboardInterrupt: give the child SIGINT's default, as a
    command typed at a terminal has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def trained(work) -> tuple[Path, dict]:
    """One run of the command, as a user would type it."""
    out = work / "head"
    proc = command(work / "recipe.yaml", "-o", out, "--prompts", work / "prompts.jsonl", "--data", work / "data.jsonl",
                   "--max-steps", STEPS, "--max-new", 48, "--holdout", 0.25, "--warmup", 10, "--batch-tokens", 1024,
                   "--minutes", 30, "--eval-minutes", 60)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, json.loads((out / "distill.json").read_text())


def check_training_gain(record: dict, loss_ratio: float) -> tuple[dict, dict]:
    """The run's held-out figures before (step 0) and after, on the same anchors: the loss below
    ``loss_ratio`` of the untrained head's and E[L] up by more than 0.3. Returns both."""
    before, after = record["curve"][0], record["final"]
    assert record["steps"] == STEPS and before["step"] == 0
    assert after["anchors"] == before["anchors"] > 50
    assert after["loss"] < loss_ratio * before["loss"], (before, after)
    assert after["expected_length"] > before["expected_length"] + 0.3, (before, after)
    return before, after


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    before, after = check_training_gain(trained[1], loss_ratio=0.6)
    assert after["acceptance"][0] > before["acceptance"][0] + 0.15, (before, after)
    assert after["teacher_agreement"] > 0.99  # the held-out greedy responses are the target's own


def test_the_output_is_a_checkpoint_with_its_provenance(trained, work):
    out, record = trained
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "distill.json", "model.safetensors", "state"]
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == record["data"]["vocabulary"]["draft_vocab"]
    assert config["eagle_aux_hidden_state_layer_ids"] == record["taps"] == [2, 2, 1]  # [2, L//2, L-3], L = 4
    saved = json.loads((out / "distill.json").read_text())
    assert saved["steps"] == STEPS and saved["target"]["source"]["init_std"] == 0.15
    assert saved["data"]["prompts"][0]["lines"] == len(TOPICS) and len(saved["data"]["prompts"][0]["sha256"]) == 64
    assert saved["data"]["data"][0]["lines"] == 2
    stats = saved["data"]["stats"]  # every prompt greedy, the 12 training prompts sampled once, the 2 data lines
    assert stats["sequences"] == len(TOPICS) + 12 + 2 and stats["greedy"] == len(TOPICS)
    assert saved["wall_seconds"] > saved["train_seconds"] > 0 and saved["draft_len"] == 3
    assert not [p for p in work.iterdir() if p.name.startswith(".head.")]  # no temporaries beside it


def test_the_checkpoint_builds_and_decodes_losslessly(trained, work):
    from specexport.runtime import load

    out, _ = trained
    recipe = {"name": "tiny-distilled", "target": TARGET, "drafters": [{"kind": "eagle3", "name": "distilled",
                                                                        "path": str(out)}]}
    engines = build(recipe, work, work / "engines")
    check_parity(engines, "distilled")
    check_greedy_lossless(load(engines), "distilled")


def _copy(trained, tmp_path: Path) -> Path:
    shutil.copytree(trained[0], tmp_path / "head")
    return tmp_path / "head"


def test_resume_continues_the_step_count(trained, work, tmp_path):
    out = _copy(trained, tmp_path)
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", out, "--resume", "--max-steps", STEPS + 20,
                           "--minutes", 30, "--quiet")
    assert code == 0, err
    record = json.loads((out / "distill.json").read_text())
    assert record["steps"] == STEPS + 20
    assert [(r["from_step"], r["to_step"]) for r in record["runs"]] == [(0, STEPS), (STEPS, STEPS + 20)]
    assert [c["step"] for c in record["curve"]] == [0, STEPS, STEPS + 20]
    assert record["final"]["loss"] <= trained[1]["final"]["loss"] * 1.05


def test_init_fine_tunes_a_trained_head(trained, work, tmp_path):
    """--init from a published-style folder (config.json and model.safetensors only): the run's
    step-0 score is the trained head's own (same held-out split, same weights), not an untrained
    head's; it keeps the head's draft vocabulary and taps, and trains on from there."""
    from safetensors.torch import load_file

    published = tmp_path / "published"
    published.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(trained[0] / name, published / name)
    out = tmp_path / "tuned"
    proc = command(work / "recipe.yaml", "-o", out, "--init", published, "--prompts", work / "prompts.jsonl",
                   "--data", work / "data.jsonl", "--max-steps", 20, "--max-new", 48, "--holdout", 0.25,
                   "--warmup", 10, "--batch-tokens", 1024, "--lr", 3e-4, "--minutes", 30, "--eval-minutes", 60)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    record = json.loads((out / "distill.json").read_text())
    start, untrained, before = record["curve"][0], trained[1]["curve"][0], trained[1]["final"]
    assert start["step"] == 0 and start["anchors"] == before["anchors"]
    assert abs(start["loss"] - before["loss"]) < 0.02 * before["loss"], (start, before)
    assert start["expected_length"] > untrained["expected_length"] + 0.3, (start, untrained)
    assert record["final"]["loss"] < 1.1 * start["loss"]
    assert record["taps"] == trained[1]["taps"] and record["data"]["init"]["path"] == str(published)
    assert record["data"]["vocabulary"]["draft_vocab"] == trained[1]["data"]["vocabulary"]["draft_vocab"]
    assert load_file(str(out / "model.safetensors"))["d2t"].tolist() == \
        load_file(str(published / "model.safetensors"))["d2t"].tolist()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_keeps_the_last_checkpoint(trained, work, tmp_path, error):
    """Checkpoints every few steps, then Ctrl-C (or a crash): the folder holds the last whole
    checkpoint, which loads and resumes; nothing half-written is left beside it."""
    from specexport.exporter.distill import checkpoint
    from specexport.exporter.distill.command import Interrupted, distill

    out = _copy(trained, tmp_path)
    seen = []

    def stop(kind: str, step: int) -> None:
        seen.append((kind, step))
        if kind == "step" and step == STEPS + 5:
            raise error()

    with pytest.raises(Interrupted if error is KeyboardInterrupt else RuntimeError) as caught:
        distill(options(work, out, resume=True, prompts=[], data=[], max_steps=STEPS + 40, eval_minutes=1e-6), on_event=stop)
    saved = [step for kind, step in seen if kind == "checkpoint"]
    assert saved and saved[-1] < STEPS + 5
    state = checkpoint.read(out)
    assert state.info["step"] == saved[-1] == json.loads((out / "distill.json").read_text())["steps"]
    assert [p.name for p in tmp_path.iterdir()] == ["head"]
    if error is KeyboardInterrupt:
        assert f"checkpoint of step {saved[-1]}" in str(caught.value) and caught.value.exit_code == 130


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_run(trained, work, tmp_path):
    """KeyboardInterrupt raised inside a ``__del__`` or weakref callback is printed as "Exception
    ignored" and lost; the run must still stop at the next step, keeping its last checkpoint."""
    from specexport.exporter.distill import checkpoint
    from specexport.exporter.distill.command import Interrupted, distill

    out = _copy(trained, tmp_path)

    def swallow(kind: str, step: int) -> None:
        if kind == "step" and step == STEPS + 3:
            try:  # what a finalizer running when Ctrl-C lands does with the interrupt
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            except KeyboardInterrupt:
                pass

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(Interrupted) as caught:
            distill(options(work, out, resume=True, prompts=[], data=[], max_steps=STEPS + 40, eval_minutes=1e-6),
                    on_event=swallow)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) is previous  # the run's handler is gone with it
    assert str(caught.value).startswith(f"interrupted at step {STEPS + 3}; ")
    assert checkpoint.read(out).info["step"] == STEPS + 2


def test_ctrl_c_on_the_command_keeps_the_last_checkpoint(trained, work, tmp_path):
    """SIGINT to a running `specexport distill --resume`: exit 130, one line naming the step the
    folder holds, and that checkpoint whole."""
    import signal
    import time

    from specexport.exporter.distill import checkpoint

    out = _copy(trained, tmp_path)
    proc = command(work / "recipe.yaml", "-o", out, "--resume", "--minutes", 5, "--eval-minutes", 0.0001)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if json.loads((out / "distill.json").read_text())["steps"] > STEPS + 2:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    state = checkpoint.read(out)
    assert state.info["step"] > STEPS
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specexport: error: interrupted at step "), err
    assert lines[0].endswith(f"{out} holds the checkpoint of step {state.info['step']}; continue with --resume"), err
    assert [p.name for p in tmp_path.iterdir()] == ["head"]


def test_an_interrupt_before_the_first_checkpoint_writes_nothing(work, tmp_path):
    from specexport.exporter.distill.command import Interrupted, distill

    def stop(kind: str, step: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="no checkpoint was written"):
        distill(options(work, tmp_path / "head", prompts=[]), on_event=stop)  # --data alone: no generation
    assert list(tmp_path.iterdir()) == []


BAD = [
    (["--drafter", "medusa"], "--drafter: unknown kind 'medusa'"),
    (["--drafter", "dflash", "--layers", "1,1"], "--layers: [1, 1] repeats a layer"),
    (["--recipe-missing"], "recipe file not found"),
    (["--data", "{missing}"], "missing.jsonl: file not found"),
    (["--data", "{notjson}"], "notjson.jsonl:2: not a JSON object"),
    (["--data", "{notext}"], "notext.jsonl:1: each line needs 'text' or 'messages'"),
    (["--prompts", "{chat}"], "chat.jsonl:1: 'messages' must be a non-empty list"),
    ([], "distill needs training text"),
    (["--resume"], "holds no distill checkpoint"),
    (["--device", "tpu"], "--device: 'tpu' is not cpu or cuda"),
    (["--prompts", "{good}", "--init", "{nohead}"], "nohead/config.json not found"),
    (["--prompts", "{good}", "--init", "{shipped}"], "it was trained for another target"),
    (["--drafter", "dflash", "--init", "{nohead}"], "--init: fine-tuning from a trained head is supported for "
                                                     "--drafter eagle3"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_and_exit_2(work, tmp_path, args, message):
    files = {"missing": tmp_path / "missing.jsonl", "notjson": tmp_path / "notjson.jsonl",
             "notext": tmp_path / "notext.jsonl", "chat": tmp_path / "chat.jsonl", "nohead": tmp_path / "nohead",
             "good": work / "prompts.jsonl", "shipped": Path(__file__).parents[2] / "heads/smollm2-eagle3"}
    files["notjson"].write_text('{"text": "fine"}\nnot json\n')
    files["notext"].write_text('{"prompt": "a prompt is not training text"}\n')
    files["chat"].write_text('{"messages": "hello"}\n')
    recipe = work / "recipe.yaml"
    if args == ["--recipe-missing"]:
        recipe, args = tmp_path / "nowhere.yaml", ["--prompts", str(work / "prompts.jsonl")]
    args = [a.format(**files) for a in args]
    code, out, err = run_cli("distill", recipe, "-o", tmp_path / "out", *args)
    assert code == 2, (out, err)
    lines = [line for line in err.strip().splitlines() if not line.startswith("✓")]  # steps done before it
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="torch sees a CUDA device here")
def test_device_cuda_without_cuda_is_one_line_and_exit_2(work, tmp_path):
    """--device cuda where torch has no CUDA: refused in one line before anything is loaded or
    written (no output folder, nothing in the teacher's cache folder)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    code, _, err = run_cli("distill", work / "recipe.yaml", "-o", tmp_path / "out", "--prompts",
                           work / "prompts.jsonl", "--device", "cuda", "--cache-dir", cache)
    check_one_line(code, err, "--device cuda: no CUDA device is available", "--device cpu", alone=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"] and not any(cache.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device torch can use")
def test_a_two_step_distill_runs_on_cuda(work, tmp_path):
    """The same trainer on the GPU (target forward, teacher rows and head there): two steps and
    a checkpoint the loader reads on the CPU."""
    from specexport.exporter.distill.command import distill
    from specexport.exporter.heads.eagle3 import load
    from specexport.exporter.recipe import Eagle3DrafterSpec, TinySource
    from specexport.exporter.sources import load_source

    out = tmp_path / "head"
    record = distill(options(work, out, device="cuda", max_steps=2))
    assert record["steps"] == 2 and record["runs"][-1]["device"] == "cuda"
    assert record["final"]["anchors"] > 0 and record["final"]["loss"] > 0
    target = load_source(TinySource(**TARGET), work, "target")
    head = load(Eagle3DrafterSpec(kind="eagle3", path=out), target, work, "drafters.0")
    assert head.spec.taps == tuple(record["taps"])


def test_the_training_unroll_is_the_chain_the_loader_builds(trained, work):
    """The trained module, read back from model.safetensors, gives the loader's reference
    logits at step 0 (target features) and step 1 (its own hidden, one rope slot on, attending
    to the catch-up rows and itself): what training optimises is what the runtime drafts."""
    import torch
    from safetensors.torch import load_file

    from specexport.exporter.distill.eagle3_model import Eagle3Draft, rope_tables
    from specexport.exporter.heads.chain import TargetStates
    from specexport.exporter.heads.eagle3 import load
    from specexport.exporter.recipe import Eagle3DrafterSpec, TinySource
    from specexport.exporter.sources import load_source

    out, _ = trained
    target = load_source(TinySource(**TARGET), work, "target")
    head = load(Eagle3DrafterSpec(kind="eagle3", path=out), target, work, "drafters.0")
    config = json.loads((out / "config.json").read_text())
    saved = load_file(str(out / "model.safetensors"))
    embed = target.model.get_input_embeddings().weight.detach()
    ours = Eagle3Draft(config, 3, embed, rope_tables(config, 64)).eval()
    with torch.no_grad():
        for name, param in ours.checkpoint_names().items():
            param.copy_(saved[name].float())
    draft = torch.arange(len(saved["d2t"])) + saved["d2t"]

    from specexport.exporter.distill import checkpoint

    seqs = checkpoint.read(out).sequences
    ids = torch.from_numpy(seqs.ids[seqs.members(holdout=True, greedy_only=True)[0]][:40])  # [S] a held-out response
    with torch.no_grad():
        hidden = target.model(ids[None], output_hidden_states=True).hidden_states
        states = TargetStates(tuple(h[0] for h in hidden), hidden[-1][0])
        aux = torch.cat([states.hidden_states[i] for i in head.spec.taps], dim=-1)  # [S, 3H]
        n = len(ids) - 1
        steps = ours.unroll(ids[None, 1:], aux[None, : n - 1], 2)  # rows 0..n-2
        mine = [ours.lm_head(s[0]) for s in steps]  # 2 of [n-1, V_draft]
        ref0, ref_hidden = head.reference.run(ids[1:], states, None)  # [n, V], [n, H]
        torch.testing.assert_close(mine[0], ref0[: n - 1, draft], rtol=1e-4, atol=1e-4)
        for p in (0, 7, n - 2):
            ref1, _ = head.reference.run(ids[1 : p + 3], states, ref_hidden[p])
            torch.testing.assert_close(mine[1][p], ref1[-1, draft], rtol=1e-4, atol=1e-4)


def test_the_teacher_cache_is_capped_and_changes_nothing(trained, work, tmp_path):
    """Rows past the cache's size cap are recomputed, equal to the cached ones."""
    import numpy as np
    import torch

    from specexport.exporter.distill import checkpoint
    from specexport.exporter.distill.teacher import Teacher
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.sources import load_source

    state = checkpoint.read(trained[0])
    target = load_source(TinySource(**TARGET), work, "target")
    members = list(range(6))
    rows = {}
    for cap in (0, 10**9):
        (tmp_path / str(cap)).mkdir()
        teacher = Teacher(target.model, (2, 2, 1), state.draft_ids, 16, torch.device("cpu"), tmp_path / str(cap),
                          cap, 256)
        rows[cap] = [teacher.rows(state.sequences, members) for _ in range(2)]
        assert len(list((tmp_path / str(cap)).iterdir())) == (0 if cap == 0 else len(members))
        assert teacher.computed_tokens == (2 if cap == 0 else 1) * sum(len(state.sequences.ids[i]) for i in members)
    for a, b in zip(rows[0][1], rows[10**9][1]):
        assert set(a) == {"aux", "top_idx", "top_p", "amax"}
        for key in a:
            np.testing.assert_allclose(a[key].numpy(), b[key].numpy(), rtol=1e-5, atol=1e-6)


def test_a_stop_inside_a_held_block_is_raised_after_it():
    # a checkpoint is written inside held(): Ctrl-C there must not land between the folder's
    # swap and the record of its step (the interrupt's message named the step before)
    import os
    import signal
    import time

    from specexport.exporter.distill.command import StopRequests

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's: it raises
    try:
        with StopRequests() as stops:
            with stops.held():
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)  # the handler runs between bytecodes, here
                except KeyboardInterrupt:
                    pytest.fail("the stop was raised inside the held block")
            assert stops.requested
            with pytest.raises(KeyboardInterrupt):
                stops.check()
    finally:
        signal.signal(signal.SIGINT, previous)
