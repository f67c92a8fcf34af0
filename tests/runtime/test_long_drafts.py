"""Long drafts: a drafter whose drafts are free and follow the evidence (suffix decoding) drafts
past D when its row runs alone, verified in one call of the probe entry that holds the chain
(padded to it on static graphs), and adaptive depth prices those depths at that entry, checked
against the clock. Outputs equal the target alone's; batched rows and other drafters keep D."""

from __future__ import annotations

import pytest
import yaml

from specexport.runtime import load
from specexport.runtime.acceptance_estimate import AcceptanceEstimate
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.runner import ModelRunner
from specexport.runtime.suffix_drafter import SuffixDrafter
from tests.conftest import tiny_recipe, tuned_copy

D = 2  # the plan's depth: verify entries of 2 and 3 tokens
PROBES = [8, 16]  # the long sizes: a row alone verifies up to 15 drafts in one call
PROMPTS = ["a b a b a b a b a b a", "The cat sat on the mat. The cat sat on the", "1, 2, 3, 1, 2, 3, 1, 2"]


def cost_of(entry) -> float:
    """ms rising with the tokens a call runs: a long entry pays only where most drafts are kept
    (the same at every batch size, so batched rows draft too)."""
    return 1.0 + 0.25 * entry.tokens


def build_with_probes(root, attention: str):
    from specexport.exporter.builder import build
    from specexport.progress import Reporter

    recipe = tiny_recipe(root / "long.yaml", name=f"tiny-long-{attention}", drafters=[{"kind": "ngram"}],
                         max_seq_len=96, prefill_chunk=12, max_draft=D, attention=attention, batch=(1, 2))
    data = yaml.safe_load(recipe.read_text())
    data["draft"]["probe_tokens"] = PROBES
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    build(recipe, root / "engines", False, Reporter(quiet=True))
    return tuned_copy(root / "engines", root / "tuned", cost_of)


@pytest.fixture(scope="module", params=["ort-gqa", "standard"])
def engines(request, tmp_path_factory):
    return build_with_probes(tmp_path_factory.mktemp(f"long-{request.param}"), request.param)


@pytest.fixture
def picks(monkeypatch):
    """Every engine choice of a runner: (tokens asked, a verify pass, engine size run)."""
    seen: list[tuple[int, bool, int]] = []
    pick = ModelRunner._pick

    def spy(self, remaining, verify=False):
        choice = pick(self, remaining, verify)
        seen.append((remaining, verify, choice[0]))
        return choice

    monkeypatch.setattr(ModelRunner, "_pick", spy)
    return seen


def test_a_long_drafter_alone_drafts_past_d_in_one_long_verify_and_equals_the_target_alone(engines, picks):
    pipe = load(engines, threads=2, check_prices=False)
    assert pipe.manifest.draft_len == D and pipe.target.long_sizes == PROBES
    longest = 0
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=48).token_ids
        for _ in range(2):  # the second time the store holds the first answer: long matches
            spec = pipe.generate(prompt_ids=ids, drafter="suffix", max_new_tokens=48)
            assert spec.token_ids == want, prompt
            longest = max(longest, *spec.stats.round_drafts)
        ngram = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48)
        assert ngram.token_ids == want and max(ngram.stats.round_drafts) <= D  # not a long drafter
    assert longest > D
    long_verifies = [(asked, size) for asked, verify, size in picks if verify and asked > 1 + D]
    assert long_verifies, "no verify past the verify entries ran"
    # each in one call of the smallest probe holding it (padded), never chunked into verify entries
    assert all(size == min(p for p in PROBES if p >= asked) for asked, size in long_verifies), long_verifies
    assert not [asked for asked, verify, size in picks if not verify and size in PROBES]  # prefill never runs a probe


def test_batched_rows_keep_d_and_a_row_left_alone_drafts_long(engines, monkeypatch):
    pipe = load(engines, threads=2, check_prices=False)
    asked: list[tuple[int, list[int]]] = []  # each round's rows and the depths it asked the drafter for
    propose = SuffixDrafter.propose
    monkeypatch.setattr(SuffixDrafter, "propose", lambda self, rows, budget:
                        asked.append((len(rows), list(budget.depths))) or propose(self, rows, budget))
    loop = pipe.batch_loop(drafter="suffix", max_batch=2)
    for key, (prompt, tokens) in enumerate(zip(PROMPTS[:2], (16, 40))):  # the first leaves early
        loop.submit(key, pipe.batch_request(pipe.prompt_ids(prompt), max_new_tokens=tokens)[0])
    for _ in loop.run():
        pass
    together = [depths for rows, depths in asked if rows == 2]
    alone = [depths for rows, depths in asked if rows == 1]
    assert together and alone
    assert 0 < max(d for depths in together for d in depths) <= D
    assert max(d for depths in alone for d in depths) > D


def test_long_depths_are_priced_at_the_probe_entry_that_runs_them(engines):
    pipe = load(engines, threads=2, check_prices=False)
    entries = {e.tokens: e for e in pipe.manifest.engines_of("target", "onnxruntime")}
    policy = pipe.costs.depth_policy(pipe.drafter("suffix"), pipe.target)
    for tokens in range(1, 1 + D + 1):  # the verify entries, as before (static graphs: the one holding them)
        entry = entries[pipe.target.engine_size(tokens)]
        assert policy.verify_cost(tokens) == pytest.approx(cost_of(entry) / 1e3), tokens
    for tokens in range(2 + D, PROBES[-1] + 1):  # past them: the smallest probe holding the tokens
        probe = min(p for p in PROBES if p >= tokens)
        assert policy.verify_cost(tokens) == pytest.approx(cost_of(entries[probe]) / 1e3), tokens


def kept_chains(tag: str, depth: int, accepted: int, rounds: int = 30) -> AcceptanceEstimate:
    estimate = AcceptanceEstimate()
    for _ in range(rounds):
        estimate.observe_chain(tag, depth, accepted)
    return estimate


def test_a_long_draft_is_verified_only_where_its_expected_tokens_pay_for_the_larger_verify(engines):
    pipe = load(engines, threads=2)
    tag, longest = "suffix/m12", PROBES[-1] - 1

    def policy(estimate: AcceptanceEstimate) -> DepthPolicy:
        made = pipe.costs.depth_policy(pipe.drafter("suffix"), pipe.target)
        made.estimate = estimate
        return made

    # kept whole: the widest entry pays (16 tokens for 5 ms against 3 for 1.75 ms)
    assert policy(kept_chains(tag, longest, longest)).best_depth(tag, longest, sunk=True) == longest
    # the first draft alone kept: no long verify pays for it
    assert policy(kept_chains(tag, longest, 1)).best_depth(tag, longest, sunk=True) <= D
    # kept whole, but the clock says the long entry takes 40 ms: priced so, it is no longer chosen
    slow = policy(kept_chains(tag, longest, longest))
    assert slow.prices is not None
    for _ in range(slow.prices.window):
        slow.prices.observe(1, longest, 0.040)
    assert slow.best_depth(tag, longest, sunk=True) < longest
