"""Token trees through the engines (tiny llama with a tree verify graph, both attention kinds):
greedy output equals the target alone with the n-gram tree drafter and with a drafter that
hides the target's own continuation behind a decoy at every level (so every round accepts a
path of non-adjacent rows and the cache must be compacted), sampled output follows the target's
exact distribution, and a verifier that skips compaction is caught."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime.drafters import Stateless
from specexport.runtime.loop import BatchLoop
from specexport.runtime.tree import DraftTree
from specexport.runtime.tree_verify import TreeVerifier
from tests.conftest import TINY_SHAPE, copy_engines
from tests.lossless import assert_sampled_as_target, exact_sequence_probs, sample_counts

NODES = 6
PROMPTS = ["a b a b a b a b a b a", "The cat sat on the mat. The cat sat on the", "1, 2, 3, 1, 2, 3, 1, 2"]


# (attention, the caches in the device store on the CPU: runtime/device_store.py): in-place
# compaction through the device store with ort-gqa, from an appending pass's presents with standard
@pytest.fixture(scope="module", params=[("standard", False), ("ort-gqa", False), ("ort-gqa", True)],
                ids=["standard", "ort-gqa", "ort-gqa-device-store"])
def pipe(request, tiny_engines):
    from specexport.runtime import load

    attention, device_store = request.param
    engines = tiny_engines.get("llama", drafters=("ngram",), attention=attention, tree_nodes=NODES, **TINY_SHAPE)
    # fixed prices: each generate starts afresh (the loops of a pipeline otherwise share what
    # the clock and the acceptance said, and a test's trees would hang on the tests before it)
    return load(engines, threads=2, device_store=device_store, check_prices=False)


class DecoyTreeDrafter(Stateless):
    """Knows the target's greedy continuation of each prompt and hides it: at each level a decoy
    first, the true token second, the next level under the true one. The accepted path is rows
    2, 4, 6."""

    name = "decoy-tree"
    builds_trees = True

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int):
        self.continuations, self.vocab = continuations, vocab

    def tree(self, row, depth, nodes, top_k):
        prompt = next(p for p in self.continuations if tuple(row.context[: len(p)].tolist()) == p)
        done = len(row.context) - len(prompt)
        truth = self.continuations[prompt][done : done + depth]
        tokens, parents, parent = [], [], -1
        for token in truth:
            if len(tokens) + 2 > nodes:
                break
            tokens += [(token + 1) % self.vocab, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), "decoy") if tokens else None


class NoCompaction(TreeVerifier):
    """The failing control: keeps the cache as the verify pass wrote it (rows in tree order)."""

    def commit(self, length, path, slot=0):
        if not self.in_place:
            self.store.write(self._presents, [(slot, length, 1 + len(path))])
        cache = self.caches[slot]
        cache.set_length(min(length, cache.length))
        cache.advance(length + 1 + len(path) - cache.length)


def decode_with(pipe, drafter, prompts, max_new, verifier_class=TreeVerifier, on_round=None):
    """Every prompt decoded at once through the batch loop (one slot each) with tree rounds:
    each one's tokens and stats."""
    target = pipe.batched_target()  # a slot for every row of the largest batch built
    base = pipe.tree_verifier(target)
    verifier = verifier_class(base.engines, pipe.manifest.engines_of("target", "onnxruntime", tree=True)[-1],
                              base.caches, base.store)
    out: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
    loop = BatchLoop(target, drafter, draft_len=pipe.manifest.draft_len, eos_ids=frozenset(),
                     on_token=lambda key, token: out[key].append(token), tree_verifier=verifier, tree_nodes=NODES,
                     on_round=on_round)
    for key, ids in enumerate(prompts):
        loop.submit(key, pipe.batch_request(ids, max_new_tokens=max_new)[0])
    finished = {}
    for ended in loop.run():
        finished.update(ended)
    return [out[key] for key in range(len(prompts))], [finished[key].stats for key in range(len(prompts))]


def decoy(pipe, prompts, max_new):
    """The target's greedy continuations of ``prompts`` and the drafter that hides them."""
    want = [pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=max_new).token_ids for ids in prompts]
    vocab = pipe.manifest.models["target"].vocab_size
    return want, DecoyTreeDrafter({tuple(ids): w for ids, w in zip(prompts, want)}, vocab)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ngram_tree_equals_the_target_alone(pipe, prompt):
    ids = pipe.prompt_ids(prompt)
    want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=48).token_ids
    got = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=NODES)
    assert got.token_ids == want
    assert got.stats.tree_nodes > 0  # trees were verified, not only chains
    chain = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=0)
    assert chain.token_ids == want and chain.stats.tree_nodes == 0


def test_tree_pass_costs_stay_fixed_once_known(pipe):
    # adaptive tree size reads the tree passes' costs, timed on first ask (or tuned) and fixed
    # then, as adaptive depth's are: a running average of the passes run made a seeded run's
    # trees depend on the clock, and ratcheted them down (a size timed slow once was not chosen,
    # so never timed again)
    ids = pipe.prompt_ids(PROMPTS[0])
    first = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=NODES)
    verifier = pipe.tree_verifier(pipe.batched_target(1))
    costs = [verifier.cost(1 + n) for n in range(1, NODES + 1)]
    again = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=NODES)
    assert first.stats.tree_nodes > 0 and again.stats.tree_nodes == first.stats.tree_nodes
    assert [verifier.cost(1 + n) for n in range(1, NODES + 1)] == costs


def test_a_hidden_path_is_accepted_and_the_cache_compacted(pipe):
    ids = [pipe.prompt_ids(PROMPTS[1])]
    want, drafter = decoy(pipe, ids, 40)
    got, stats = decode_with(pipe, drafter, ids, 40)
    assert got == want
    assert stats[0].acceptance_length > 2.5  # three levels of true tokens behind decoys: most rounds take them all


def test_skipping_compaction_is_caught(pipe):
    ids = [pipe.prompt_ids(PROMPTS[1])]
    want, drafter = decoy(pipe, ids, 40)
    got, _ = decode_with(pipe, drafter, ids, 40, verifier_class=NoCompaction)
    assert got != want  # the decoys' K/V left where the path's should be: the output moves


def test_sampled_tree_output_follows_the_target(pipe):
    from specexport.runtime.acceptance import Sampling

    ids = pipe.prompt_ids(PROMPTS[0])
    sampling = Sampling(1.0, top_k=3)
    exact = exact_sequence_probs(pipe, ids, sampling, 2)
    draws = 1500
    counts, stats = sample_counts(pipe, ids, draws, drafter="ngram", tree_nodes=NODES, max_new_tokens=2,
                                  temperature=1.0, top_k=3)
    assert sum(s.tree_nodes for s in stats) > 0
    assert_sampled_as_target(counts, exact, draws, right_rule=True)


def test_rules_apply_to_each_tree_node(pipe):
    # penalties and a grammar rule every node with its own path: the tree's output is the ruled target's
    pytest.importorskip("llguidance")
    import json

    from specexport.runtime.grammar import GrammarSpec
    from specexport.runtime.rules import Controls, Penalties

    ids = pipe.prompt_ids(PROMPTS[0])
    schema = {"type": "object", "properties": {"a": {"enum": ["b a b", "a b a"]}, "n": {"type": "integer",
                                                                                    "maximum": 99}},
              "required": ["a", "n"], "additionalProperties": False}
    for controls in (Controls(Penalties(repetition=1.3, frequency=0.8, presence=0.2)),
                     Controls(grammar=GrammarSpec("json_schema", json.dumps(schema)))):
        want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=40, controls=controls).token_ids
        got = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=40, tree_nodes=NODES, controls=controls)
        assert got.token_ids == want and got.stats.tree_nodes > 0
        assert want != pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=40).token_ids


def test_generate_tree_nodes_from_the_command_line(tiny_engines):
    from tests.conftest import check_one_line, run_cli

    engines = tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", tree_nodes=NODES, **TINY_SHAPE)
    code, out, err = run_cli("generate", engines, "-p", PROMPTS[0], "-d", "ngram", "-n", "12", "--tree-nodes", "4",
                             "--json")
    assert code == 0, err
    import json

    assert json.loads(out)["stats"]["tree_nodes"] > 0
    code, _, err = run_cli("generate", engines, "-p", PROMPTS[0], "-d", "ngram", "--tree-nodes", str(NODES + 1))
    check_one_line(code, err, "--tree-nodes")
    plain = tiny_engines.get("llama", drafters=("ngram",), **TINY_SHAPE)
    code, _, err = run_cli("generate", plain, "-p", PROMPTS[0], "-d", "ngram", "--tree-nodes", "2")
    check_one_line(code, err, "no tree graph")


@pytest.fixture(scope="module", params=[("standard", False), ("ort-gqa", False), ("standard", True)],
                ids=["standard", "ort-gqa", "standard-device-store"])
def batched(request, tiny_engines):
    """A tiny llama with chain and tree graphs at batch 1, 2 and 4 (and whether its caches are
    in the device store)."""
    from specexport.runtime import load

    attention, device_store = request.param
    engines = tiny_engines.get("llama", drafters=("ngram",), attention=attention, batch=(1, 2, 4),
                               tree_nodes=NODES, **TINY_SHAPE)
    # fixed prices: each generate starts afresh (the loops of a pipeline otherwise share what
    # the clock and the acceptance said, and a test's trees would hang on the tests before it)
    return load(engines, threads=2, device_store=device_store, check_prices=False)


def test_batched_rows_verify_their_trees_in_one_pass(batched):
    # three sequences (the batch-4 graph, one slot idle), each its own decoy tree: every row
    # takes its hidden path, its own cache compacted; each equals the target alone
    ids = [batched.prompt_ids(p) for p in PROMPTS]
    want, drafter = decoy(batched, ids, 40)
    rounds = []
    got, stats = decode_with(batched, drafter, ids, 40, on_round=rounds.append)
    assert got == want
    assert all(s.acceptance_length > 2.5 for s in stats)
    assert any(r.rows == 3 and r.batch == 4 and r.width > 1 for r in rounds), rounds[:5]  # tree passes of three rows together


def test_skipping_compaction_in_a_batch_is_caught(batched):
    ids = [batched.prompt_ids(p) for p in PROMPTS[1:]]
    want, drafter = decoy(batched, ids, 40)
    got, _ = decode_with(batched, drafter, ids, 40, verifier_class=NoCompaction)
    assert got[0] != want[0] and got[1] != want[1]


def test_a_batched_loop_decodes_ngram_trees_together(batched):
    # two sequences decode trees together at batch 2; once one ends, the other goes on alone
    ids = [batched.prompt_ids(PROMPTS[1]), batched.prompt_ids(PROMPTS[2])]
    want = [batched.generate(prompt_ids=i, drafter="none", max_new_tokens=n).token_ids for i, n in zip(ids, (48, 12))]
    out: dict[int, list[int]] = {0: [], 1: []}
    rounds = []
    loop = batched.batch_loop(drafter="ngram", max_batch=2, tree_nodes=NODES, on_round=rounds.append,
                              on_token=lambda key, token: out[key].append(token))
    for key, (prompt, n) in enumerate(zip(ids, (48, 12))):
        loop.submit(key, batched.batch_request(prompt, max_new_tokens=n)[0])
    finished = {}
    for ended in loop.run():
        finished.update(ended)
    assert [out[0], out[1]] == want
    assert finished[0].stats.tree_nodes > 0 and finished[1].stats.tree_nodes > 0
    assert {r.batch for r in rounds if r.width > 1} >= {1, 2}


def test_generate_prompts_file_decodes_trees_together(batched, tmp_path):
    # generate --prompts-file --tree-nodes: the batched loop's tree rounds, each output the
    # target's alone
    import json

    from tests.conftest import run_cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[1:])))
    code, out, err = run_cli("generate", batched.manifest.root, "--prompts-file", prompts, "-d", "ngram", "-n", "24",
                             "--tree-nodes", "4", "--max-batch", "2", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    for line, prompt in zip(lines, PROMPTS[1:]):
        want = batched.generate(prompt_ids=batched.prompt_ids(prompt), drafter="none", max_new_tokens=24).token_ids
        assert line["token_ids"] == want
    assert len(lines) == 2 and all(line["stats"]["tree_nodes"] > 0 for line in lines)


def test_sampled_trees_in_a_batch_follow_the_target(batched):
    # two rows sample together through batch-2 tree rounds: row 0's continuations are distributed
    # as the target's, with its own rng and its own rows of the pass beside another row's
    from specexport.runtime.acceptance import Sampling

    ids = [batched.prompt_ids(PROMPTS[0]), batched.prompt_ids(PROMPTS[2])]
    exact = exact_sequence_probs(batched, ids[0], Sampling(1.0, top_k=3), 2)
    draws, counts, nodes = 1500, {}, 0
    for seed in range(draws):
        first, _ = batched.generate_batch(ids, drafter="ngram", max_new_tokens=2, temperature=1.0, top_k=3, seed=seed,
                                          tree_nodes=NODES, max_batch=2, schedule=False)
        counts[tuple(first.token_ids)] = counts.get(tuple(first.token_ids), 0) + 1
        nodes += first.stats.tree_nodes
    assert nodes > draws // 2  # most draws verified a tree beside the other row
    assert_sampled_as_target(counts, exact, draws, right_rule=True)


@pytest.mark.parametrize("batch,precision", [((1,), "fp32"), ((1, 2, 4), "fp32"), ((1,), "int4")])
def test_ort_gqa_chains_and_trees_run_on_one_session(tiny_engines, batch, precision):
    # the target's one graph verifies chains and trees: its tree entries point at the chain
    # entries' file, and decoding both ways opens one onnxruntime session, one copy of the weights
    # (int4: the graph pads a one-token call's tree inputs with its pad row too, exporter/row_pad.py)
    from specexport.contract import CHAIN_TREE_INPUTS
    from specexport.runtime import load

    engines = tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", batch=batch, tree_nodes=NODES,
                               precision=precision, **TINY_SHAPE)
    pipe = load(engines, threads=2)
    target = [e for e in pipe.manifest.engines if e.model == "target"]
    assert {e.path for e in target} == {"target.onnx"}
    assert all(set(CHAIN_TREE_INPUTS) <= set(e.inputs) for e in target if e.role == "tree")
    assert not any(set(CHAIN_TREE_INPUTS) & set(e.inputs) for e in target if e.role != "tree")
    ids = pipe.prompt_ids(PROMPTS[1])
    want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=24).token_ids
    tree = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=24, tree_nodes=NODES)
    chain = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=24, tree_nodes=0)
    assert tree.token_ids == want == chain.token_ids and tree.stats.tree_nodes > 0
    assert len(pipe.sessions) == 1


def test_tune_times_the_tree_graphs_and_tree_rounds_read_them(tiny_engines, tmp_path, monkeypatch):
    # `specexport tune` times every tree verify graph at every batch size; a pipeline loaded
    # afterwards sizes trees by those figures instead of timing the graphs on first use
    import json

    from specexport.contract import Manifest, Role
    from specexport.runtime import load
    from specexport.runtime.costs import COSTS
    from tests.conftest import run_cli

    copy = tmp_path / "engines"
    copy_engines(tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", batch=(1, 2),
                                     tree_nodes=NODES, **TINY_SHAPE), copy)
    code, _, err = run_cli("tune", copy, "--rounds", "1", "--threads", "2")
    assert code == 0, err
    costs = json.loads((copy / COSTS).read_text())["engines"]["onnxruntime"]
    trees = [e for e in Manifest.load(copy).engines if e.role == Role.TREE]
    assert {e.batch for e in trees} == {1, 2} and all(costs[e.name] > 0 for e in trees)

    def untimed(self, key, want_logits=False):
        raise AssertionError(f"the tree graph {key} was timed although tuned")

    monkeypatch.setattr(TreeVerifier, "time_run", untimed)
    pipe = load(copy, threads=2)
    verifier = pipe.tree_verifier(pipe.batched_target())
    for batch in (1, 2):
        for rows in range(2, NODES + 2):
            name = next(e.name for e in trees if (e.batch, e.tokens) == (batch, rows))
            assert verifier.cost(rows, batch) == pytest.approx(costs[name] / 1e3)
    ids = pipe.prompt_ids(PROMPTS[1])
    got = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=24, tree_nodes=NODES)  # adaptive: sized by them
    assert got.token_ids == pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=24).token_ids
    assert got.stats.tree_nodes > 0
