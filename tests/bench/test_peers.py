"""The bench's peers: other stacks on the same model must produce our greedy output exactly.

Fast tests use the tiny llama of recipes/tiny-llama.yaml (the session's shared tiny build). The
onnxruntime-genai peers run in `make test` (onnxruntime-genai is in the dev extra; building the
tiny model for it takes about 25 s on 2 cores); only an install without it skips them. On the
default model they run in `make bench-peers` (building genai's model from the GGUF takes minutes,
too long for the suite).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from specexport.bench import peers as peers_mod
from specexport.bench.peers import PEER_NAMES, PeerRun, make_peers
from specexport.errors import BadInput
from tests.conftest import REPO, TINY_SHAPE

HAVE_ORT_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
needs_ort_genai = pytest.mark.skipif(not HAVE_ORT_GENAI,
                                     reason="onnxruntime-genai is not installed (pip install -e '.[dev]')")

NEW_TOKENS = 24
HF_PEERS = ["transformers-greedy", "transformers-prompt-lookup"]
OG_PEERS = ["ort-genai", "ort-genai-ngram"]


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """make_peers sets torch's thread count for the process; give the other tests theirs back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_engines) -> Path:
    """The session's shared tiny llama build: its target is recipes/tiny-llama.yaml's
    (test_the_shared_build_has_the_shipped_tiny_target)."""
    return tiny_engines.get("llama", **TINY_SHAPE)


@pytest.fixture(scope="module")
def target(tiny) -> dict:
    return json.loads((tiny / "manifest.json").read_text())["recipe"]["target"]


@pytest.fixture(scope="module")
def pipe(tiny):
    from specexport.runtime import load

    return load(tiny, threads=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peers-cache")


@pytest.fixture(scope="module")
def tiny_peers(tiny, target, cache) -> dict:
    names = HF_PEERS + (OG_PEERS if HAVE_ORT_GENAI else [])
    made, skipped = make_peers(target, tiny, names, 2, cache)
    assert skipped == []
    assert [p.name for p in made] == names
    return {p.name: p for p in made}


def test_the_shared_build_has_the_shipped_tiny_target(target):
    from specexport.exporter.recipe import load_recipe

    shipped, _ = load_recipe(REPO / "recipes" / "tiny-llama.yaml")
    assert target == shipped.target.model_dump(mode="json")


def prompts(pipe) -> dict[str, list[int]]:
    return {
        "chat": pipe.prompt_ids(messages=[{"role": "user", "content": "Tell me about cats and dogs."}]),
        "raw": pipe.prompt_ids("def add(a, b):\n    return a + b\n"),
    }


def check_run(run: PeerRun, max_new_tokens: int) -> None:
    assert 1 <= len(run.token_ids) <= max_new_tokens
    assert all(isinstance(t, int) for t in run.token_ids)
    assert run.total_s > 0 and run.first_token_s > 0


@pytest.mark.parametrize("name", HF_PEERS)
def test_transformers_peers_equal_our_runtime(tiny_peers, pipe, name):
    peer = tiny_peers[name]
    assert peer.threads == 2 and peer.settings["attn_implementation"] == "sdpa"
    for label, ids in prompts(pipe).items():
        ours = pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS).token_ids
        run = peer.run(ids, NEW_TOKENS)
        check_run(run, NEW_TOKENS)
        assert run.token_ids == ours, f"{name} on the {label} prompt"
        # decode timed within the run, from the first step's tokens to the last's: every
        # token after the first step's is counted once (greedy: one per step)
        assert run.decode_s is not None and 0 < run.decode_s < run.total_s
        assert 1 <= run.decode_tokens <= len(run.token_ids) - 1
        if name == "transformers-greedy":
            assert run.decode_tokens == len(run.token_ids) - 1


@pytest.fixture(scope="module")
def greedy(tiny_peers, pipe) -> dict[str, list[int]]:
    """transformers-greedy's output on each of prompts(), once for every peer compared with it."""
    return {label: tiny_peers["transformers-greedy"].run(ids, NEW_TOKENS).token_ids
            for label, ids in prompts(pipe).items()}


@needs_ort_genai
@pytest.mark.parametrize("name", OG_PEERS)
def test_ort_genai_peers_equal_transformers_greedy(tiny_peers, pipe, greedy, name):
    peer = tiny_peers[name]
    assert peer.threads == 2 and peer.settings["intra_op_num_threads"] == 2
    for label, ids in prompts(pipe).items():
        run = peer.run(ids, NEW_TOKENS)
        check_run(run, NEW_TOKENS)
        assert run.token_ids == greedy[label], f"{name} on the {label} prompt"


@needs_ort_genai
def test_ort_genai_ngram_verifies_lookups(tiny_peers, pipe):
    """A prompt of repeats makes the n-gram lookup propose, so the multi-token verify and the
    rewind run; the random model rejects the drafts and the output is still greedy."""
    ids = pipe.prompt_ids("abcabcabcabcabcabcabcab")
    run = tiny_peers["ort-genai-ngram"].run(ids, NEW_TOKENS)
    assert run.stats["ngram_lookup_hits"] >= 1 and run.stats["draft_tokens_proposed"] >= 1
    assert run.token_ids == tiny_peers["transformers-greedy"].run(ids, NEW_TOKENS).token_ids


class RecordedBuilder:
    """peers' subprocess for a test: onnxruntime-genai's model builder is recorded and stood in
    for by a copy of the model it built before (the real one takes about 25 s); the rest of
    subprocess as it is."""

    def __init__(self, built: Path):
        self.built, self.calls = built, []

    def run(self, cmd, **kwargs):
        self.calls.append(cmd)
        shutil.copytree(self.built, cmd[cmd.index("-o") + 1])
        return subprocess.CompletedProcess(cmd, 0)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


@needs_ort_genai
def test_ort_genai_model_is_built_once(tiny_peers, tiny, target, cache, tmp_path, monkeypatch):
    model_dir = cache / peers_mod.ORT_GENAI_DIR
    stamp = model_dir / peers_mod.ORT_GENAI_STAMP
    assert stamp.is_file() and not (cache / "hf").exists()  # the builder's input is removed
    built = (model_dir / "model.onnx").stat().st_mtime_ns
    builder = RecordedBuilder(shutil.copytree(model_dir, tmp_path / "built-before"))
    monkeypatch.setattr(peers_mod, "subprocess", builder)
    made, skipped = make_peers(target, tiny, ["ort-genai"], 2, cache)
    assert skipped == [] and builder.calls == [] and (model_dir / "model.onnx").stat().st_mtime_ns == built

    # A stamp for another target (or version) is rebuilt, not trusted.
    stamp.write_text(json.dumps({"target": "something else"}))
    made, skipped = make_peers(target, tiny, ["ort-genai"], 2, cache)
    assert skipped == [] and len(builder.calls) == 1 and "onnxruntime_genai.models.builder" in builder.calls[0]
    assert json.loads(stamp.read_text())["target"] == target


def test_missing_ort_genai_is_skipped_with_the_fix(tiny, target, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec",
                        lambda name, *args: None if name == "onnxruntime_genai" else find_spec(name, *args))
    made, skipped = make_peers(target, tiny, OG_PEERS, 2, tmp_path)
    assert made == []
    assert [s["peer"] for s in skipped] == OG_PEERS
    assert all("onnxruntime-genai is not installed: make bench-peers" == s["skipped"] for s in skipped)
    assert not any(tmp_path.iterdir())  # nothing was built or saved


def test_unknown_peer_and_bad_arguments(tiny, target, tmp_path):
    made, skipped = make_peers(target, tiny, ["vllm"], 2, tmp_path)
    assert made == [] and skipped[0]["peer"] == "vllm" and "known: " + ", ".join(PEER_NAMES) in skipped[0]["skipped"]
    with pytest.raises(BadInput, match="threads"):
        make_peers(target, tiny, ["transformers-greedy"], 0, tmp_path)
    with pytest.raises(BadInput, match="target source"):
        make_peers({"source": "onnx", "path": "x"}, tiny, ["transformers-greedy"], 2, tmp_path)


def test_unloadable_target_is_skipped(tmp_path):
    made, skipped = make_peers({"source": "hf", "path": "no-such-model"}, tmp_path, HF_PEERS, 2, tmp_path)
    assert made == []
    assert all("model directory not found" in s["skipped"] for s in skipped)


# --- peers in processes of their own (what the bench runs) ---------------------------------


def test_a_peer_in_its_own_process_equals_it_in_process(tiny_peers, pipe, tiny, target, cache):
    """start_peers runs transformers-greedy in a fresh interpreter: the same tokens as the
    in-process peer and our runtime, its settings reported, and the process gone after close."""
    from specexport.bench.peer_process import close_peers, start_peers

    peers, skipped = start_peers(target, tiny, ["transformers-greedy", "vllm"], 2, cache)
    try:
        assert [p.name for p in peers] == ["transformers-greedy"]
        assert skipped[0]["peer"] == "vllm" and "known: " in skipped[0]["skipped"]
        peer = peers[0]
        assert peer.threads == 2 and peer.settings == tiny_peers["transformers-greedy"].settings
        process = peer._process
        assert process.pid != __import__("os").getpid() and process.poll() is None
        for label, ids in prompts(pipe).items():
            run = peer.run(ids, NEW_TOKENS)
            check_run(run, NEW_TOKENS)
            assert run.token_ids == tiny_peers["transformers-greedy"].run(ids, NEW_TOKENS).token_ids, label
            assert run.token_ids == pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS).token_ids, label
        batch = peer.run_batch(list(prompts(pipe).values()), NEW_TOKENS)
        assert batch.token_ids == tiny_peers["transformers-greedy"].run_batch(list(prompts(pipe).values()),
                                                                             NEW_TOKENS).token_ids
        with pytest.raises(BadInput, match="peer transformers-greedy: a peer needs a non-empty prompt"):
            peer.run([], NEW_TOKENS)  # the child's one-line error, and the child lives on
        assert peer.run(prompts(pipe)["raw"], 4).token_ids
    finally:
        close_peers(peers)
    assert process.poll() is not None  # ended, not left behind
    with pytest.raises(BadInput, match="its process ended"):
        peer.run(prompts(pipe)["raw"], 4)


def test_start_peers_refuses_bad_arguments_in_one_line(tiny, tmp_path):
    from specexport.bench.peer_process import start_peers

    with pytest.raises(BadInput, match="threads"):
        start_peers({"source": "hf", "path": "x"}, tiny, ["transformers-greedy"], 0, tmp_path)
    with pytest.raises(BadInput, match="target source"):  # raised in the child, re-raised here
        start_peers({"source": "onnx", "path": "x"}, tiny, ["transformers-greedy"], 2, tmp_path)


def test_peer_decode_rate_prefers_the_time_taken_in_the_run():
    from specexport.bench.summary import _peer_decode_rate

    record = {"token_ids": [1] * 11, "total_s": 3.0, "first_token_s": 1.0}
    assert _peer_decode_rate(record) == pytest.approx(10 / 2.0)  # two runs apart
    assert _peer_decode_rate({**record, "decode_s": 2.5}) == pytest.approx(10 / 2.5)  # in the run
    assert _peer_decode_rate({**record, "token_ids": [1]}) is None
    assert _peer_decode_rate({**record, "first_token_s": 3.5}) is None
    # a peer whose first step emitted several tokens (prompt lookup) says how many came after it
    assert _peer_decode_rate({**record, "decode_s": 2.5, "decode_tokens": 7}) == pytest.approx(7 / 2.5)


def _peer_processes() -> list[int]:
    """Live processes running bench/peer_process.py whose parent is this process."""
    import os

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"specexport.bench.peer_process" in cmdline:
            found.append(int(entry.name))
    return found


def test_bench_interleaves_a_peer_in_its_own_process(tiny, tmp_path):
    """`bench --peers` end to end: the peer runs in its own process, on every prompt, alternating
    which side goes first; its output equals ours and its process is gone afterwards."""
    from tests.bench.short_prompts import short_prompts
    from tests.conftest import run_cli

    out = tmp_path / "out"
    code, _, err = run_cli("bench", tiny, "--drafters", "ngram", "--peers", "transformers-greedy", "-n", "6",
                           "--repeats", "2", "--prompts", short_prompts(tmp_path / "p.jsonl", 3), "--out", out,
                           "--threads", "2")
    assert code == 0, err
    result = json.loads((out / "bench.json").read_text())
    rows = result["peers"]
    assert [r["prompt_id"] for r in rows] == ["a", "b", "c"] and result["peers_skipped"] == []
    assert all(r["matches_baseline"] is True and r["tokens_per_s"] > 0 for r in rows)
    assert _peer_processes() == []


def test_bench_alternates_which_side_runs_first(monkeypatch):
    import contextlib

    from specexport.bench import harness

    order = []
    monkeypatch.setattr(harness, "_our_runs", lambda pipe, drafters, prompt, *rest: order.append(("ours", prompt["id"])) or [])
    monkeypatch.setattr(harness, "_peer_runs", lambda peers, prompt, *rest: order.append(("peer", prompt["id"])) or [])
    options = harness.BenchOptions(prompts=Path("x"), max_new_tokens=4, repeats=2)

    class Reporter:
        def step(self, *args):
            return contextlib.nullcontext(type("Step", (), {"detail": ""})())

    prompts = [{"id": "a", "category": "c"}, {"id": "b", "category": "c"}]
    harness._interleaved_runs(None, options, Reporter(), prompts, [], {"a": [1], "b": [2]}, [], {}, {})
    assert order == [("ours", "a"), ("peer", "a"), ("peer", "b"), ("ours", "b"),  # repeat 1
                     ("peer", "a"), ("ours", "a"), ("ours", "b"), ("peer", "b")]  # repeat 2


def test_transformers_assistant_runs_the_recipes_draft_model_and_equals_our_runtime(tiny, target, pipe, cache):
    """transformers-assistant: generate(assistant_model=the recipe's kind: model drafter), greedy,
    so its output is the target's."""
    from specexport.bench.peers import draft_model_source

    source = draft_model_source(pipe.manifest.recipe)
    assert source is not None
    made, skipped = make_peers(target, tiny, ["transformers-assistant"], 2, cache, draft_source=source)
    assert skipped == [] and made[0].settings["assistant_layers"] == source.get("num_layers", 1)
    for label, ids in prompts(pipe).items():
        run = made[0].run(ids, NEW_TOKENS)
        check_run(run, NEW_TOKENS)
        assert run.token_ids == pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS).token_ids, label
    made, skipped = make_peers(target, tiny, ["transformers-assistant"], 2, cache)  # no draft model given
    assert made == [] and "no draft model" in skipped[0]["skipped"]
