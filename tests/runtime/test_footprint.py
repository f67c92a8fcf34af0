"""Deployment footprint: loads that check integrity without re-hashing everything, `verify`,
`tune` (costs measured where the engines run), memory and first-token figures in --json."""

import json
import logging
import os
import subprocess
import sys

import pytest

from specexport.contract import Manifest
from specexport.errors import BadInput
from specexport.runtime import load
from specexport.runtime.costs import COSTS
from specexport.runtime.integrity import RECORD, scan
from specexport.runtime.runner import time_interleaved
from tests.conftest import REPO, TINY_SHAPE, copy_engines, run_cli


@pytest.fixture
def engines(tiny_engines, tmp_path):
    copy = tmp_path / "engines"
    copy_engines(tiny_engines.get("llama", **TINY_SHAPE), copy)
    return copy


def _hashed(directory) -> set[str]:
    """The files a load-time check re-hashes now (runs the check)."""
    return {c.path for c in scan(Manifest.load(directory)) if c.hashed}


def _flip_byte(path, at: int = 64) -> None:
    """Change one byte, keeping the size."""
    with open(path, "r+b") as fh:
        fh.seek(at)
        old = fh.read(1)
        fh.seek(at)
        fh.write(bytes([old[0] ^ 0xFF]))


# -- integrity -------------------------------------------------------------------------------


def test_second_load_rehashes_nothing_and_a_changed_file_is_caught(engines):
    load(engines)  # first use: everything hashed, the record written beside the directory
    record = json.loads((engines / RECORD).read_text())
    assert set(record["files"]) == set(Manifest.load(engines).files)
    assert _hashed(engines) == set()  # nothing changed: nothing re-read
    _flip_byte(engines / "target.weights")
    assert _hashed(engines) == {"target.weights"}
    with pytest.raises(BadInput, match="target.weights: sha256 does not match"):
        load(engines)


def test_a_tamper_with_its_mtime_put_back_is_still_rehashed(engines):
    load(engines)
    path = engines / "target.verify.b1.t5.onnx"
    before = os.stat(path)
    _flip_byte(path, at=200)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    # utime itself moves the ctime, which no user call sets back: the key changed
    code, _, err = run_cli("generate", engines, "--prompt", "hi", "-n", "2")
    assert code == 2 and "target.verify.b1.t5.onnx: sha256 does not match" in err, err


def test_load_trusts_an_unchanged_key_and_verify_checks_everything(engines):
    """The record's limit, shown: whoever can rewrite the record (here: keys forged to match a
    changed file) passes a load; `specexport verify` hashes everything and catches it."""
    load(engines)
    _flip_byte(engines / "target.weights")
    record = json.loads((engines / RECORD).read_text())
    st = os.stat(engines / "target.weights")
    record["files"]["target.weights"]["key"] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    (engines / RECORD).write_text(json.dumps(record))
    load(engines)  # trusted: not re-hashed
    code, out, err = run_cli("verify", engines, "--json")
    assert code == 2 and "target.weights: sha256 does not match" in err, err
    rows = {row["file"]: row for row in json.loads(out)["files"]}
    assert rows["target.weights"]["ok"] is False and rows["target.weights"]["size"] == st.st_size
    assert all(row["ok"] for name, row in rows.items() if name != "target.weights")
    with pytest.raises(BadInput, match="target.weights"):  # verify dropped it from the record
        load(engines)


def test_verify_table_and_the_manifest_hash(engines):
    code, out, err = run_cli("verify", engines)
    assert code == 0, err
    assert "target.weights" in out and "manifest.json" in out and "CHANGED" not in out
    code, out, _ = run_cli("verify", engines, "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    # the builder wrote manifest.sha256 in sha256sum's format
    assert (engines / "manifest.sha256").read_text().endswith("  manifest.json\n")
    raw = json.loads((engines / "manifest.json").read_text())
    raw["plan"]["reason"] += " (edited)"
    (engines / "manifest.json").write_text(json.dumps(raw))
    code, out, err = run_cli("verify", engines, "--json")
    assert code == 2 and "manifest.json: does not match manifest.sha256" in err, err


def test_a_changed_manifest_means_a_full_check(engines):
    load(engines)
    assert _hashed(engines) == set()
    raw = json.loads((engines / "manifest.json").read_text())
    raw["name"] = "renamed"
    (engines / "manifest.json").write_text(json.dumps(raw))
    assert _hashed(engines) == set(raw["files"])


def test_a_copied_directory_is_checked_in_full(engines, tmp_path):
    load(engines)
    copy = tmp_path / "copy"
    copy_engines(engines, copy)  # the record travels along, but names another directory
    assert (copy / RECORD).is_file()
    assert _hashed(copy) == set(Manifest.load(copy).files)


def test_record_falls_back_to_the_user_cache(engines, tmp_path):
    """Where the record cannot be written beside the directory (read-only; here its name is
    taken by a directory, since root ignores permissions), it goes to $XDG_CACHE_HOME."""
    (engines / RECORD).unlink(missing_ok=True)  # a record the cached tiny build was copied with
    (engines / RECORD).mkdir()
    cache = tmp_path / "cache"
    script = ("import sys; from specexport.runtime.integrity import scan; from specexport.contract import Manifest;"
              "print(sum(c.hashed for c in scan(Manifest.load(sys.argv[1]))))")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", script, str(engines)], capture_output=True, text=True, env=env,
                           cwd=REPO, check=True).stdout.strip() for _ in range(2)]
    assert runs == [str(len(Manifest.load(engines).files)), "0"]
    assert [p.name for p in cache.rglob(RECORD)] == [RECORD]


# -- tuned costs -----------------------------------------------------------------------------


def test_tune_writes_costs_and_the_runtime_uses_them(engines):
    code, out, err = run_cli("tune", engines, "--rounds", "2", "--json", "--accept-noise")  # tiny graphs: noisy
    assert code == 0, err
    written = json.loads(out)
    costs = json.loads((engines / COSTS).read_text())
    assert written["written_to"] == str(engines / COSTS)
    assert {"hostname", "cpu", "threads", "onnxruntime"} <= set(costs["machine"]) and costs["measured"]
    manifest = Manifest.load(engines)
    assert set(costs["engines"]["onnxruntime"]) == {e.name for e in manifest.engines}  # every model's graphs
    assert [c["tokens"] for c in costs["curve"]] == sorted(e.tokens for e in manifest.engines_of("target", "onnxruntime"))
    label = f"tuned ({costs['machine']['hostname']}, {costs['measured']})"
    assert load(engines).costs_source == label
    code, out, err = run_cli("generate", engines, "--prompt", "hi", "-n", "3", "--json")
    assert code == 0 and json.loads(out)["costs"] == label, err
    code, out, _ = run_cli("plan", engines, "--json")
    assert code == 0 and json.loads(out)["costs"] == label


def test_tuned_costs_change_the_runners_plan(engines):
    built = load(engines)
    assert built.costs_source == "build" and built.target.engine_size(16) == 16  # one prefill chunk
    run_cli("tune", engines, "--rounds", "1")
    costs = json.loads((engines / COSTS).read_text())
    costs["engines"]["onnxruntime"]["target.prefill.b1.t16"] = 1000.0  # a prefill chunk this machine hates
    (engines / COSTS).write_text(json.dumps(costs))
    tuned = load(engines)
    assert tuned.target.engine_size(16) < 16  # cheaper as smaller pieces now
    assert load(engines, tuned_costs=False).target.engine_size(16) == 16


def test_costs_of_another_manifest_are_ignored_with_a_warning(engines, caplog):
    run_cli("tune", engines, "--rounds", "1")
    raw = json.loads((engines / "manifest.json").read_text())
    raw["name"] = "rebuilt"
    (engines / "manifest.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING):
        pipe = load(engines)
    assert pipe.costs_source == "build"
    assert any("measured for another manifest" in r.getMessage() for r in caplog.records)


class _Recorder:
    """Records the order of timed runs (no engines)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def time_run(self, size, want_logits=False):
        self.calls.append((self.name, size))
        return float(size)

    def end_timing(self, sizes):
        self.calls.append((self.name, "end"))


def test_timing_interleaves_every_model_round_after_round():
    calls = []
    a, b = _Recorder("a", calls), _Recorder("b", calls)
    times = time_interleaved({"a": (a, [1, 5]), "b": (b, [1])}, rounds=2)
    # warm-up, then 2 rounds, each starting one graph later (no graph always timed first)
    assert calls == [("a", 1), ("a", 5), ("b", 1), ("a", 5), ("b", 1), ("a", 1), ("b", 1), ("a", 1), ("a", 5),
                     ("a", "end"), ("b", "end")]
    assert times == {"a": {1: 1.0, 5: 5.0}, "b": {1: 1.0}}


def test_a_smaller_graph_never_costs_more_than_a_larger_one():
    """A tuned file once measured the 1-token graph dearer than the 2-token one: uncapped, every
    decode step ran the 2-token graph with a padded row."""
    from specexport.runtime.runner import monotone_costs

    assert monotone_costs({1: 36.3, 2: 28.9, 4: 34.1, 6: 33.4, 8: 39.6, 16: None, 64: 150.0}) == {
        1: 28.9, 2: 28.9, 4: 33.4, 6: 33.4, 8: 39.6, 16: None, 64: 150.0}
    assert monotone_costs({1: 20.0, 2: 25.0}) == {1: 20.0, 2: 25.0}  # sane figures are kept


def test_the_runner_decodes_one_token_with_the_one_token_graph_whatever_the_noise(tiny_engines):
    from specexport.runtime.runner import ModelRunner

    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    target = pipe.target
    engines = [target._by_size[t] for t in target.decoding_sizes]
    assert target.decoding_sizes[:2] == [1, 2]
    noisy = {t: float(t) + 10.0 for t in target.decoding_sizes}
    noisy[1] = noisy[2] + 5.0  # the 1-token graph timed in a busy moment
    runner = ModelRunner("target", engines, target.cache, {e.name: t for t, e in zip(target.decoding_sizes, engines)},
                         noisy, target._in_place)
    assert runner.engine_size(1) == 1 and runner.engine_size(2) == 2


def test_build_times_all_models_in_one_schedule(tiny_engines):
    manifest = Manifest.load(tiny_engines.get("llama", **TINY_SHAPE))
    steps = [s["what"] for s in manifest.build["steps"] if s["kind"] == "validate"]
    assert steps[-1] == "costs (all graphs, interleaved)"  # one step after every model's validation
    assert all(e.cost_ms for e in manifest.engines)


# -- memory and first token ------------------------------------------------------------------


def test_generate_json_reports_memory_and_first_token(engines):
    code, out, err = run_cli("generate", engines, "--prompt", "hello there", "-n", "4", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["costs"] == "build"
    assert result["memory"]["peak_rss_mb"] >= result["memory"]["rss_mb"] > 10
    assert result["load_to_first_token_s"] > result["first_token_s"] > 0
    pipe = load(engines)
    first, second = pipe.generate("hi", max_new_tokens=2), pipe.generate("hi", max_new_tokens=2)
    assert first.load_to_first_token_s is not None and second.load_to_first_token_s is None
