"""Hidden-state heads in the batched loop (issue 11): EAGLE-3, MTP, DFlash and DSpark draft for
every running row, each row's head state fed that row's target features (the batched verify
pass's aux_hidden_states of the positions it committed). Every request decodes as it would
alone: greedy, the same tokens as its own batch-1 ``generate``; sampled, the target's
distribution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from specexport.contract import (
    AUX_HIDDEN_STATES,
    BLOCK_HIDDEN,
    CONTEXT_FEATURES,
    DRAFT_FEATURES,
    HIDDEN_OUT,
    LOGITS,
    NEXT_TOKENS,
    DraftSchedule,
    past_names,
    present_names,
)
from specexport.errors import SpecexportError
from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from specexport.runtime.api import Pipeline
from specexport.runtime.block_drafter import BlockDrafter
from specexport.runtime.chain_drafter import ChainDrafter
from specexport.runtime.engine import EngineOptions
from specexport.runtime.loop import BatchLoop, Request
from specexport.runtime.ort_engine import OrtEngine
from tests.conftest import copy_engines
from tests.heads.block_checkpoints import (
    TARGET,
    tiny_target,
    write_speculators_dflash,
    write_speculators_dspark,
)
from tests.heads.chain_checkpoints import write_eagle3, write_mtp_speculators
from tests.lossless import (
    assert_each_position_sampled_as_target,
    exact_sequence_probs,
    residual_is_q,
    rules,
    use_rule,
)

HEADS = ("eagle3", "mtp", "dflash", "dspark")


def build_heads(root: Path) -> Path:
    """One tiny ort-gqa build with batch sizes 1, 2 and 4 and one head of every kind."""
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.recipe import parse_recipe
    from specexport.progress import Reporter

    target = tiny_target()
    write_eagle3(root / "eagle3", target.config, "speculators", layer_ids=[0, 1, 3])
    write_mtp_speculators(root / "mtp", target.config)
    write_speculators_dflash(root / "dflash", target, draft_vocab=100)  # its own head: drafts vary
    write_speculators_dspark(root / "dspark", target)  # its own head, an rnn Markov head
    raw = {"name": "batched-heads", "target": TARGET, "attention": "ort-gqa",
           "drafters": [{"kind": kind, "name": kind, "path": kind} for kind in HEADS],
           "shapes": {"batch": [1, 2, 4], "max_seq_len": 64, "prefill_chunk": 8},
           "draft": {"tile": 128, "max_draft": 3}}
    out = root / "out"
    build_recipe(parse_recipe(raw, "recipe"), root, out, False, Reporter(quiet=True))
    return out


@pytest.fixture(scope="module")
def heads_engines(tmp_path_factory) -> Path:
    return build_heads(tmp_path_factory.mktemp("batched-heads"))


@pytest.fixture(scope="module")
def pipe(heads_engines):
    return load(heads_engines)


def _prompts() -> list[list[int]]:
    """Prompts of different lengths (one of a single token), some repetitive."""
    rng = np.random.default_rng(3)
    motif = rng.integers(3, 200, size=4).tolist()
    return [rng.integers(3, 200, size=6).tolist(), (motif * 5)[:13], [42], rng.integers(3, 200, size=20).tolist(),
            (motif * 4)[:9], rng.integers(3, 200, size=3).tolist(), (motif * 3)[:11]]


class RecordingRows:
    """The loop's batched drafter, recording each sequence's rounds (by the order it joined in):
    [(committed length, depth, drafts)], depth 0 included."""

    def __init__(self, inner):
        self.inner, self.name, self.needs, self.builds_trees = inner, inner.name, inner.needs, inner.builds_trees
        self.drafts_free, self.drafts_long = inner.drafts_free, inner.drafts_long
        self.seen: dict[int, list[tuple]] = {}
        self._key: dict[int, int] = {}  # slot -> the sequence in it

    @property
    def engine_seconds(self) -> float:
        return self.inner.engine_seconds

    def join(self, slot, prompt, target_out):
        self._key[slot] = len(self.seen)
        self.seen[len(self.seen)] = []
        self.inner.join(slot, prompt, target_out)

    def prefill(self, slot):
        self.inner.prefill(slot)

    def catchup_cost(self, skipped):
        return self.inner.catchup_cost(skipped)

    def propose(self, rows, budget):
        drafts = self.inner.propose(rows, budget)
        for slot, (row, k, draft) in enumerate(zip(rows, budget.depths, drafts)):
            self.seen[self._key[slot]].append((len(row.context), k, draft.tokens.tolist()))
        return drafts

    def accept(self, slot, n_accepted, next_token, target_out):
        self.inner.accept(slot, n_accepted, next_token, target_out)

    def leave(self, slot, context, prompt_len):
        self.inner.leave(slot, context, prompt_len)

    def move(self, src, dst):
        self._key[dst] = self._key[src]
        self.inner.move(src, dst)


class Replay:
    """A depth policy that gives the depths a row had in the batched loop, round by round."""

    prices = None  # it prices nothing

    def __init__(self, depths: list[int]):
        from specexport.runtime.acceptance_estimate import AcceptanceEstimate

        self._depths = iter(depths)
        self.estimate = AcceptanceEstimate()  # told every round, read by nothing here

    def best_depth(self, name: str, k: int, batch: int = 1, remaining: int = 0) -> int:
        return next(self._depths)


def _alone(pipe, drafter: str, prompt: list[int], budget: int, depths: list[int]) -> tuple[list[int], list[tuple]]:
    """The tokens and drafting rounds of ``drafter`` decoding ``prompt`` alone (a loop of one
    slot, generate's) at ``depths``."""
    from tests.runtime.fakes import decode

    recording = RecordingRows(pipe.drafter(drafter))
    tokens, _ = decode(pipe.model("target"), recording, prompt, draft_len=pipe.manifest.draft_len,
                       max_new_tokens=budget, sampling=Sampling(), eos_ids=pipe.text.eos_ids, policy=Replay(depths))
    return tokens, [r for r in recording.seen[0] if r[1] > 0]


@pytest.mark.parametrize("kind", HEADS)
def test_every_head_decodes_and_drafts_in_the_batch_as_alone(pipe, kind):
    """Seven requests through four slots, two joining before every round: rows leave mid-batch
    (the last row's head state moves into the freed slot), batch sizes 4, 2 and 1 as the queue
    drains, a one-token prompt. The schedule drafts 3 at one row, 2 at two and four (batched
    catch-up and step calls at batch 2 and 4) and none at three, so rows sit at depth 0 for
    rounds and then catch up. Each request's tokens equal its own
    ``generate``; each round it drafted in, its drafts equal what the single-sequence head
    drafts at the same position and depth (its head state stayed consistent with its row)."""
    prompts, budgets = _prompts(), [5, 20, 30, 40, 12, 3, 30]
    target = pipe.batched_target()
    chosen = pipe.drafter(kind, target.slots)
    assert type(chosen) is (ChainDrafter if kind in ("eagle3", "mtp") else BlockDrafter)
    recording = RecordingRows(chosen)
    loop = BatchLoop(target, recording, draft_len=pipe.manifest.draft_len, eos_ids=pipe.text.eos_ids,
                     schedule=DraftSchedule(((1, 3), (2, 2), (3, 0), (4, 2))))
    done: dict = {}
    for i in range(0, len(prompts), 2):  # staggered: two arrive before each round
        for j in range(i, min(i + 2, len(prompts))):
            loop.submit(j, Request(np.asarray(prompts[j], dtype=np.int64), budgets[j]))
        done.update(loop.step())
    for ended in loop.run():
        done.update(ended)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        want = pipe.generate(prompt_ids=prompt, drafter=kind, max_new_tokens=budget, adaptive=False).token_ids
        assert done[i].tokens == want, (kind, i)
        # the depths the row had, round by round (0: it only verified), replayed alone
        rounds = recording.seen[i]
        tokens, alone = _alone(pipe, kind, prompt, budget, [k for _, k, _ in rounds])
        assert tokens == want
        assert alone == [r for r in rounds if r[1] > 0], (kind, i)
    depths = [k for i in recording.seen for _, k, _ in recording.seen[i]]
    assert 3 in depths and 2 in depths
    # a row drafted again after more rounds at depth 0 than a round's catch-up takes (1+D rows)
    assert any("0" * (pipe.manifest.draft_len + 1) + "1" in "".join(str(min(k, 1)) for _, k, _ in recording.seen[i])
               for i in recording.seen)


# (head, prompt, warping, tokens): a flat warp over the whole vocabulary, under which the tiny
# random head's q overlaps the target's p: drafts are sometimes kept, so both acceptance and
# rejection are exercised, and a wrong residual is far off
SAMPLED = [("eagle3", "x = 1\nx =", Sampling(temperature=3.0), 2),
           ("dflash", "hello", Sampling(temperature=3.0, top_p=0.95), 2)]


@pytest.mark.parametrize("rule", rules(residual_is_q))
@pytest.mark.parametrize("kind, prompt, sampling, length", SAMPLED)
def test_batched_sampled_tokens_follow_the_target(pipe, kind, prompt, sampling, length, rule, monkeypatch):
    """A chain head and a block head, sampled in batches of four beside a prompt at another
    position: each row draws its drafts from the warped head distribution with its own rng,
    then rejection sampling; each of the first tokens is distributed as the target alone would
    draw it (chi-square against the exact warped target probabilities, position by position: too
    many two-token sequences to fill). The control: the same draws with the replacement token
    drawn from q, not max(0, p − q), must fail."""
    ids = pipe.prompt_ids(prompt)
    other = pipe.prompt_ids("another prompt, at another position")
    exact = exact_sequence_probs(pipe, ids, sampling, length)
    draws = 600
    use_rule(monkeypatch, rule)
    results = pipe.generate_batch([ids, other] * draws, drafter=kind, max_new_tokens=length, seed=0, adaptive=False,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    counts: dict[tuple[int, ...], int] = {}
    for result in results[::2]:
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    if rule is None:
        assert set(counts) <= set(exact), f"{set(counts) - set(exact)} are outside the target's support"
        proposed, accepted = sum(r.stats.proposed for r in results), sum(r.stats.accepted for r in results)
        assert proposed > accepted > 0  # drafts were verified: some kept, some rejected
    assert_each_position_sampled_as_target(counts, exact, draws, right_rule=rule is None)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_heads_without_batched_graphs_run_per_slot(pipe, kind):
    """A directory built before batched head graphs (the head has batch-1 graphs only): each
    row's head calls run through its slot's batch-1 graphs in turn (runtime/model.py), and it
    still decodes as alone."""
    manifest = dataclasses.replace(pipe.manifest, engines=[
        e for e in pipe.manifest.engines if not (e.model == kind and e.batch > 1)])
    old = Pipeline(manifest, pipe.options, pipe.backend)
    head = old.drafter(kind, old.batched_target().slots)
    assert not (head.catchup.calls if kind == "eagle3" else head.calls)
    prompts = _prompts()[:5]
    together = old.generate_batch(prompts, drafter=kind, max_new_tokens=10, adaptive=False)
    for prompt, got in zip(prompts, together):
        assert got.token_ids == pipe.generate(prompt_ids=prompt, drafter=kind, max_new_tokens=10,
                                              adaptive=False).token_ids
    assert sum(g.stats.proposed for g in together) > 0


class RowsSwapped:
    """A batched graph that hands row 0's outputs to row 1 and row 1's to row 0: what a graph
    that mixes up its rows gives."""

    def __init__(self, engine):
        self.engine, self.name, self.inputs, self.outputs = engine, engine.name, engine.inputs, engine.outputs

    def run(self, feeds, outputs=None, bound=None):
        return {name: array[[1, 0, *range(2, len(array))]] for name, array in self.engine.run(feeds, outputs).items()}


def _chain_rows(pipe, graph: str, width: int, rng):
    from specexport.exporter.heads.chain import _draftable, batched_rows

    entry = next(e for e in pipe.manifest.engines if e.name == graph)
    s_max = pipe.manifest.models[entry.model].max_seq_len
    rows, valid = batched_rows(4, entry.tokens, ".step." in graph, s_max, rng.integers(3, 200, size=s_max),
                               rng.standard_normal((s_max, width)).astype(np.float32),
                               rng.standard_normal((s_max, width)).astype(np.float32))
    return rows, valid, [LOGITS, NEXT_TOKENS, HIDDEN_OUT], {"figures": _draftable}


def _block_rows(pipe, graph: str, width: int, rng):
    from specexport.exporter.heads.block import block_rows

    entry = next(e for e in pipe.manifest.engines if e.name == graph)
    rows, valid = block_rows(4, entry.tokens, 40, width, pipe.manifest.models["target"].vocab_size, rng)
    block = (LOGITS, NEXT_TOKENS, BLOCK_HIDDEN)
    return rows, valid, list(block), {"figures": lambda got, want, _: (got, want, None), "whole": block}


@pytest.mark.parametrize("graph, single, rows_of", [("mtp.catchup.b4.t4", "mtp.catchup.b1.t4", _chain_rows),
                                                    ("mtp.step.b4.t1", "mtp.step.b1.t1", _chain_rows),
                                                    ("dspark.block.b4.t4", "dspark.block.b1.t4", _block_rows)])
def test_the_build_check_of_batched_head_graphs_fails_on_a_wrong_row(pipe, heads_engines, graph, single, rows_of):
    """The build's row-by-row check of a batched head graph against its batch-1 graph
    (validate.check_batched_rows, run by the chain and block head builds): the real graph
    passes (the build recorded its figures), a graph whose rows are swapped fails in one line
    naming the row."""
    from specexport.exporter.validate import check_batched_rows

    entries = {e.name: e for e in pipe.manifest.engines}
    assert entries[graph].parity["reference"] == "the batch-1 graph, row by row"
    assert entries[graph].parity["argmax_agreement"] == 1.0
    engines = {name: OrtEngine(name, heads_engines / entries[name].path, entries[name].inputs, entries[name].outputs,
                               EngineOptions()) for name in (graph, single)}
    info = pipe.manifest.models[entries[graph].model]
    rng = np.random.default_rng(0)
    past = {name: rng.standard_normal(info.kv.shape(1)).astype(np.float32) for name in past_names(info.num_layers)}
    features = DRAFT_FEATURES if DRAFT_FEATURES in entries[graph].inputs else CONTEXT_FEATURES
    rows, valid, outputs, how = rows_of(pipe, graph, entries[graph].inputs[features].shape[-1], rng)
    outputs += present_names(info.num_layers)
    parity, _ = check_batched_rows(graph, engines[graph], engines[single], past, rows, valid, outputs, **how)
    assert parity.agree == parity.positions > 0
    with pytest.raises(SpecexportError, match=f"{graph}: row 0 .* differs in .* from the batch-1 graph"):
        check_batched_rows(graph, RowsSwapped(engines[graph]), engines[single], past, rows, valid, outputs, **how)


def test_serve_and_generate_prompts_file_take_the_heads(pipe, heads_engines, tmp_path):
    """The server's check accepts every head; `generate --prompts-file` decodes with one as
    `generate` does alone."""
    from specexport.cli.serve import check_servable
    from tests.conftest import run_cli

    assert [check_servable(heads_engines, kind, None) for kind in HEADS] == list(HEADS)
    records = [{"id": "a", "prompt": "hello there, hello there"}, {"id": "b", "prompt": "x = 1\nx = 1\nx ="},
               {"id": "c", "prompt": "abc"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_cli("generate", heads_engines, "--prompts-file", path, "--drafter", "mtp", "-n", "10",
                             "--max-batch", "2", "--fixed-depth", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    for record, line in zip(records, lines, strict=True):
        want = pipe.generate(record["prompt"], drafter="mtp", max_new_tokens=10, adaptive=False)
        assert line["token_ids"] == want.token_ids
    assert sum(line["stats"]["proposed"] for line in lines) > 0


def _rows_scaled(source: Path, out: Path, name: str) -> Path:
    """A copy of the target graph whose output ``name`` of row r is scaled by 1 + r/100: row 0
    (every batch-1 run) unchanged, the other rows of a batched run wrong."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    raw = f"{name}_raw"
    for node in graph.node:
        node.output[:] = [raw if o == name else o for o in node.output]
    const = lambda n, v, t: helper.make_node("Constant", [], [n], value=helper.make_tensor(n, t, [len(v)] if len(v) > 1 else [], v))  # noqa: E731
    graph.node.extend([
        const("k_zero", [0], TensorProto.INT64), const("k_one", [1], TensorProto.INT64),
        const("k_step", [0.01], TensorProto.FLOAT), const("k_unit", [1.0], TensorProto.FLOAT),
        const("k_axes", [1, 2], TensorProto.INT64),
        helper.make_node("Shape", [raw], ["k_shape"]),
        helper.make_node("Gather", ["k_shape", "k_zero"], ["k_rows"]),
        helper.make_node("Range", ["k_zero", "k_rows", "k_one"], ["k_index"]),
        helper.make_node("Cast", ["k_index"], ["k_indexf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["k_indexf", "k_step"], ["k_scaled"]),
        helper.make_node("Add", ["k_scaled", "k_unit"], ["k_factor"]),
        helper.make_node("Unsqueeze", ["k_factor", "k_axes"], ["k_factor3"]),  # [B, 1, 1]
        helper.make_node("Mul", [raw, "k_factor3"], [name]),
    ])
    onnx.save(model, str(out))
    return out


def test_the_build_check_of_the_batched_target_fails_when_a_rows_taps_are_wrong(pipe, heads_engines, tmp_path):
    """validate_batched compares each row's aux_hidden_states (what the heads read) with the
    batch-1 graph's on that row: the built graph passes, one whose taps are wrong for rows
    other than the first (its logits untouched) fails the build in one line naming the row."""

    from specexport.exporter.validate import BatchedGraph, validate_batched

    copy = tmp_path / "engines"
    copy_engines(heads_engines, copy)
    entries = {e.name: e for e in pipe.manifest.engines}
    specs = {name: (e.inputs, e.outputs) for name, e in entries.items()}
    ids = np.random.default_rng(1).integers(3, 200, size=pipe.max_seq_len)
    pipe.target.cache.set_length(0)
    pipe.target.forward(ids[:-1])  # the batch-1 cache filled with the text, as the build's validation has it
    single = pipe.target.cache
    graph = "target.verify.b4.t4"
    built = BatchedGraph(graph, copy / entries[graph].path, 4, 4)
    figures = validate_batched([built], {4: "target.verify.b1.t4"}, specs, single, ids, None)
    assert figures[graph]["argmax_agreement"] == 1.0
    wrong = _rows_scaled(built.path, copy / "wrong.onnx", AUX_HIDDEN_STATES)
    with pytest.raises(SpecexportError, match=f"{graph}: row 1's aux_hidden_states differs from the batch-1 graph"):
        validate_batched([BatchedGraph(graph, wrong, 4, 4)], {4: "target.verify.b1.t4"}, specs, single, ids, None)
