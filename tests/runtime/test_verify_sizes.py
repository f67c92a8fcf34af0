"""A round verifies what it drafted: an ort-gqa target has a verify entry at every size 2..1+D
(entries of its one graph), a round at depth k runs the one holding 1+k, and adaptive depth
prices that entry, never a larger one nor a probe. Directories built with one verify entry
still load and decode exactly."""

import pytest

from specexport.contract import Manifest, Role
from specexport.runtime import load
from tests.conftest import one_verify_copy, tuned_copy


def cost_of(entry) -> float:
    """Chosen costs: rising with the rows a call runs, so one piece of the smallest entry
    holding the input is always the cheapest plan."""
    return 1.0 + 0.25 * entry.tokens * entry.batch


@pytest.fixture(scope="module")
def tuned(batched_engines, tmp_path_factory):
    return tuned_copy(batched_engines, tmp_path_factory.mktemp("verify-sizes") / "engines", cost_of)


def test_every_verify_size_is_an_entry_of_the_one_graph_at_every_batch_size(batched_engines):
    manifest = Manifest.load(batched_engines)
    depth = manifest.draft_len
    assert depth >= 3, "the test needs depths between 1 and D"
    graph = {e.path for e in manifest.engines_of("target", "onnxruntime", batch=None)}
    assert graph == {"target.onnx"}  # no file of its own per size
    for batch in manifest.batch_sizes("target"):
        entries = manifest.engines_of("target", "onnxruntime", batch=batch)
        assert [e.tokens for e in entries if e.role == Role.VERIFY] == list(range(2, depth + 2)), batch
        assert len({e.tokens for e in entries}) == len(entries), batch  # one entry a size: no probe beside a verify
    assert all(e.cost_ms for e in manifest.engines_of("target", "onnxruntime") if e.role == Role.VERIFY)


def test_a_round_at_depth_k_runs_the_entry_of_1_plus_k_rows(tuned, monkeypatch):
    pipe = load(tuned)
    runner = pipe.target
    depth = pipe.manifest.draft_len
    picked = []  # (tokens asked, engine size run)
    monkeypatch.setattr(runner, "_pick", lambda remaining, verify=False, pick=runner._pick:
                        picked.append((remaining, pick(remaining, verify)[0])) or pick(remaining, verify))
    motif = [7, 21, 35, 49, 63]
    prompt = motif * 6  # the n-gram drafter finds continuations of every length
    alone = pipe.generate(prompt_ids=prompt, max_new_tokens=24, drafter="none")
    picked.clear()
    for k in range(1, depth + 1):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=24, drafter="ngram", draft_len=k, adaptive=False)
        assert spec.token_ids == alone.token_ids, k
    rounds = [(asked, size) for asked, size in picked if 2 <= asked <= 1 + depth]
    assert {asked for asked, _ in rounds} == set(range(2, depth + 2)), rounds  # every depth ran
    assert all(size == asked for asked, size in rounds), rounds
    # and the engine that ran is the verify entry of that size
    assert {runner.engine_at(size) for _, size in rounds} == {f"target.verify.b1.t{t}" for t in range(2, depth + 2)}


def test_adaptive_depth_prices_the_entry_that_runs(tuned):
    pipe = load(tuned)
    entries = {(e.batch, e.tokens): e for e in pipe.manifest.engines_of("target", "onnxruntime", batch=None)}
    policy = pipe.costs.depth_policy(pipe.drafter("ngram"), pipe.target)
    for k in range(pipe.manifest.draft_len + 1):
        size = pipe.target.engine_size(1 + k)
        assert size == 1 + k
        assert policy.verify_cost(1 + k) == pytest.approx(cost_of(entries[(1, size)]) / 1e3)


def test_a_batched_round_runs_the_narrowest_width_holding_its_longest_row(tuned):
    pipe = load(tuned)
    depth = pipe.manifest.draft_len
    for batch in (b for b in pipe.manifest.batch_sizes("target") if b > 1):
        target = pipe.batched_target(batch)
        assert target.widths(batch) == list(range(1, depth + 2))
        for tokens in range(1, depth + 2):
            assert target.graph(batch, tokens) == (batch, tokens)


def test_a_directory_with_one_verify_entry_still_loads_and_decodes_exactly(batched_engines, tmp_path):
    old = one_verify_copy(batched_engines, tmp_path / "old")
    pipe = load(old)
    depth = pipe.manifest.draft_len
    assert [t for t in pipe.target.decoding_sizes if 1 < t <= 1 + depth] == [1 + depth]
    assert pipe.target.engine_size(2) == 1 + depth  # a shallow round pads to the one verify entry
    policy = pipe.costs.depth_policy(pipe.drafter("ngram"), pipe.target)
    assert policy.verify_cost(2) == policy.verify_cost(1 + depth)  # priced at the entry that runs
    prompt = [7, 21, 35, 49, 63] * 6
    alone = pipe.generate(prompt_ids=prompt, max_new_tokens=24, drafter="none")
    for drafter in ("ngram", "quantized-self"):
        assert pipe.generate(prompt_ids=prompt, max_new_tokens=24, drafter=drafter).token_ids == alone.token_ids
    batch = pipe.generate_batch([prompt, prompt[:11]], max_new_tokens=16, drafter="ngram", max_batch=2)
    assert batch[0].token_ids == alone.token_ids[:16]
