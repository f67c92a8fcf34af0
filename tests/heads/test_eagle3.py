"""EAGLE-3 heads from tiny random checkpoints in both published layouts: build with parity,
greedy losslessness, the runtime's drafts equal the reference's greedy chain, exact sampling,
the layer-index convention, the d2t mapping, and every malformed-checkpoint error."""

from __future__ import annotations

import pytest

from specexport.errors import BadInput, SpecexportError
from tests.heads.chain_checkpoints import write_eagle3
from tests.heads.chain_reference import check_drafts_are_the_reference_chain, load_chain_heads
from tests.heads.common import (
    SHAPES,
    build,
    build_head_only,
    check_greedy_lossless,
    check_parity,
    check_sampling,
)
from tests.lossless import residual_is_q, rules

TARGET = {"source": "tiny", "arch": "llama", "num_layers": 6}


def target_config():
    from specexport.exporter.recipe import TinySource
    from specexport.exporter.tiny import byte_tokenizer, tiny_config

    return tiny_config(TinySource(**TARGET), len(byte_tokenizer()))


def recipe(*drafters) -> dict:
    return {"name": "eagle3", "target": TARGET, "drafters": list(drafters)}


BOTH_LAYOUTS = recipe({"kind": "eagle3", "name": "e-safe", "path": "safe"},
                      {"kind": "eagle3", "name": "e-spec", "path": "spec"})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One build, both layouts: SafeAILab (default taps, target embedding) and speculators
    (explicit ids, norm_before_residual, its own embedding)."""
    root = tmp_path_factory.mktemp("eagle3")
    cfg = target_config()
    write_eagle3(root / "safe", cfg, "safeailab")
    write_eagle3(root / "spec", cfg, "speculators", seed=3, layer_ids=[0, 1, 3], norm_before_residual=True,
                 with_embed=True)
    return build(BOTH_LAYOUTS, root, root / "out")


@pytest.fixture(scope="module")
def pipe(engines):
    from specexport.runtime import load

    return load(engines)


def test_both_layouts_build_with_parity(engines):
    import json

    manifest = json.loads((engines / "manifest.json").read_text())
    assert manifest["models"]["e-safe"]["taps"] == [2, 3, 3]  # [2, L//2, L-3]
    assert manifest["models"]["e-spec"]["taps"] == [0, 1, 3]  # speculators ids: hidden_states[i]
    assert manifest["models"]["target"]["taps"] == [0, 1, 2, 3]
    for name in ("e-safe", "e-spec"):
        check_parity(engines, name)


@pytest.mark.parametrize("drafter", ["e-safe", "e-spec"])
def test_greedy_is_lossless(pipe, drafter):
    check_greedy_lossless(pipe, drafter)


@pytest.fixture(scope="module")
def references(engines):
    """(target, {drafter name: loaded head}): the exporter's reference forward of each layout."""
    return load_chain_heads(BOTH_LAYOUTS, engines.parent)


@pytest.mark.parametrize("drafter", ["e-safe", "e-spec"])
def test_runtime_drafts_are_the_reference_chain(pipe, references, drafter):
    """Through the decode loop: each round's proposals (the catch-up's draft, then the step
    graph's) are the reference's greedy chain after the same committed tokens."""
    target, heads = references
    check_drafts_are_the_reference_chain(pipe, drafter, heads[drafter], target)


@pytest.mark.parametrize("rule", rules(residual_is_q))
def test_sampling_is_exact(pipe, rule, monkeypatch):
    check_sampling(pipe, "e-spec", monkeypatch, rule)


def test_drafts_map_through_d2t(pipe):
    """The step graph's next token is the draft argmax mapped by d2t, its logits -inf off the
    draft vocabulary."""
    import numpy as np

    from specexport.contract import DRAFT_FEATURES, HIDDEN_OUT
    from specexport.runtime.chain_drafter import STEP_ROLES

    runner = pipe.runner("e-safe", STEP_ROLES)
    runner.cache.set_length(0)
    hidden = np.random.default_rng(0).normal(size=(1, 64)).astype(np.float32)
    out = runner.forward([40], want_logits=True, inputs={DRAFT_FEATURES: hidden}, want=(HIDDEN_OUT,))
    finite = np.flatnonzero(np.isfinite(out.logits[0]))
    from safetensors.torch import load_file

    d2t = load_file(str(pipe.manifest.root.parent / "safe" / "model.safetensors"))["d2t"].numpy()
    assert finite.tolist() == (np.arange(len(d2t)) + d2t).tolist()
    assert out.next_tokens[0] == int(np.argmax(out.logits[0])) and out.next_tokens[0] in finite
    runner.cache.set_length(0)


def _break(monkeypatch, what: str):
    from specexport.exporter.heads import eagle3

    if what == "convention":  # read speculators ids as z-lab's (output of layer i: i + 1)
        monkeypatch.setitem(eagle3.CONVENTIONS, "speculators", lambda i: i + 1)
    elif what == "mapping":  # gate and up swapped: same shapes, wrong tensors
        names = dict(eagle3.LAYER_NAMES, gate_w="mlp.up_proj.weight", up_w="mlp.gate_proj.weight")
        monkeypatch.setattr(eagle3, "LAYER_NAMES", names)
    elif what == "d2t":
        import torch
  # the draft ids taken as target ids shifted by one
        class Flipped(eagle3.Tensors):
            def get(self, name, shape=None, dtype="float"):
                t = super().get(name, shape, dtype)
                if name != "d2t":
                    return t
                # still a valid injective map into the target vocabulary, but the wrong one
                mapped = (torch.arange(len(t)) + t).flip(0)
                return mapped - torch.arange(len(t))

        monkeypatch.setattr(eagle3, "Tensors", Flipped)  # the loader's reader only


@pytest.mark.parametrize("what", ["convention", "d2t"])
def test_a_broken_loader_fails_parity(tmp_path, monkeypatch, what):
    """The reference reads the checkpoint on its own: a loader that reads the layer ids in the
    wrong convention or mis-maps d2t fails the head's parity (a head-only build: no target
    export). One that swaps two tensors (the "mapping" break): the whole build below."""
    write_eagle3(tmp_path / "spec", target_config(), "speculators", layer_ids=[0, 1, 3])
    _break(monkeypatch, what)
    with pytest.raises(SpecexportError, match="validation failed for e.catchup|validation failed for e.prefill"):
        build_head_only(recipe({"kind": "eagle3", "name": "e", "path": "spec"}), tmp_path, tmp_path / "out")


def test_a_head_failing_parity_fails_the_whole_build(tmp_path, monkeypatch):
    """A loader that swaps two tensors (gate and up: same shapes) fails the head's parity, and
    the builder does not drop that head: the build fails and leaves no directory (the prefill
    chunk is 1+D: two target graphs before the head's)."""
    write_eagle3(tmp_path / "spec", target_config(), "speculators", layer_ids=[0, 1, 3])
    _break(monkeypatch, "mapping")
    raw = {**recipe({"kind": "eagle3", "name": "e", "path": "spec"}), "shapes": {**SHAPES, "prefill_chunk": 4}}
    with pytest.raises(SpecexportError, match="validation failed for e.catchup"):
        build(raw, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


MALFORMED = [
    ({"drop": "fc.weight"}, "tensor 'fc.weight' is missing"),
    ({"drop": "midlayer.self_attn.q_proj.weight"}, "tensor 'midlayer.self_attn.q_proj.weight' is missing"),
    ({"drop": "d2t"}, "tensor 'd2t' is missing"),
    ({"reshape": "lm_head.weight"}, "tensor 'lm_head.weight' in model.safetensors has shape"),
    ({"reshape": "midlayer.hidden_norm.weight"}, "tensor 'midlayer.hidden_norm.weight' in model.safetensors has shape"),
    ({"config_edit": {"hidden_size": "big"}}, "'hidden_size' must be a positive integer"),
    ({"config_edit": {"eagle_aux_hidden_state_layer_ids": [2, 99, 5]}}, "layer ids"),
    ({"config_edit": {"draft_vocab_size": 0}}, "'draft_vocab_size' must be a positive integer"),
]


@pytest.mark.parametrize("broken,message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_checkpoints_are_one_line_errors(tmp_path, broken, message):
    from specexport.exporter.heads.eagle3 import load
    from specexport.exporter.recipe import Eagle3DrafterSpec, TinySource
    from specexport.exporter.sources import load_source

    write_eagle3(tmp_path / "head", target_config(), "safeailab", **broken)
    target = load_source(TinySource(**TARGET), tmp_path, "target")
    spec = Eagle3DrafterSpec(kind="eagle3", path="head")
    with pytest.raises(BadInput, match=message) as err:
        load(spec, target, tmp_path, "drafters.0")
    assert "\n" not in str(err.value) and str(err.value).startswith("drafters.0")


def test_the_cli_exits_2_on_a_malformed_head(tmp_path):
    import yaml

    from tests.conftest import run_cli

    write_eagle3(tmp_path / "head", target_config(), "speculators", drop="layers.0.mlp.down_proj.weight")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**recipe({"kind": "eagle3", "path": "head"}),
                                                    "shapes": SHAPES}))
    code, _, err = run_cli("build", tmp_path / "r.yaml", "--out", tmp_path / "out")
    assert code == 2, err
    assert "layers.0.mlp.down_proj.weight" in err and "Traceback" not in err


def test_the_bench_costs_a_round_as_one_catch_up_and_a_step_per_further_draft(pipe):
    """The bench's prediction charges what a chain round runs: the catch-up call its accepted
    drafts and bonus token lead to (at most 1+k rows, on the cheapest catch-up entry holding
    them), then one step graph per further draft; a skipped round is priced at the one row's
    catch-up (ChainDrafter.round_cost)."""
    from specexport.bench.harness import measure_costs

    names = [n for n in pipe.drafter_names if n != "none"]
    depth = pipe.manifest.draft_len
    costs = measure_costs(pipe, names, repeats=3, want_logits=False, draft_len=depth)
    for name in names:
        draft = costs["draft_ms"][name]  # k = 0..D
        parts = costs["draft_parts_ms"][name]
        step = parts["step"]["1"]
        catchup = {int(t): ms for t, ms in parts["catchup"].items()}
        built = [e.tokens for e in pipe.manifest.engines_of(name, "onnxruntime") if e.role == "catchup"]
        assert sorted(catchup) == built and max(built) == depth + 1  # every round's catch-up size timed
        assert step > 0 and all(ms > 0 for ms in catchup.values())
        for k, ms in enumerate(draft):
            held = min(c for t, c in catchup.items() if t >= 1 + k)
            assert ms == pytest.approx(held + max(k - 1, 0) * step, abs=2e-3), (name, k)


def test_a_chain_round_is_priced_at_the_catch_up_entry_holding_its_rows(pipe):
    """Costs rising with the rows: a round at depth k is the catch-up of 1+k rows (2 at least)
    plus k-1 steps, not the cheapest catch-up entry whatever the rows."""
    depth = pipe.manifest.draft_len
    catchup = {t: 1.0 + t for t in range(2, depth + 2)}  # ms
    costs = {"catchup": catchup, "step": {1: 0.5}}
    drafter = pipe.drafter("e-safe")
    for k in range(depth + 1):
        expected = catchup[max(1 + k, 2)] + max(k - 1, 0) * 0.5
        assert drafter.round_cost(k, costs) == pytest.approx(expected / 1e3), k


def test_a_long_gap_is_priced_as_the_catch_up_pieces_that_run(pipe):
    """Rounds at depth 0 leave their rows to the next catch-up, which feeds more rows than the
    largest catch-up entry holds in several calls: the resumed round is priced at those calls
    (the runner's own plan), not at one entry whatever the gap (ChainDrafter.catchup_cost)."""
    drafter = pipe.drafter("e-safe")
    runner = drafter.catchup.runners[0]
    largest = max(t for t in runner.decoding_sizes if runner.planned_ms(t))
    long = 4 * largest  # a gap that takes four calls at least
    cheapest = min(runner.planned_ms(t) for t in runner.decoding_sizes)  # ms of any one call
    # four calls at least, less the one row a round without a gap feeds anyway
    assert drafter.catchup_cost(long) * 1e3 >= 4 * cheapest - runner.planned_ms(1) - 1e-9 > 0
