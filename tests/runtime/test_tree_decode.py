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
from tests.conftest import TINY_SHAPE
from tests.lossless import assert_sampled_as_target, exact_sequence_probs, sample_counts

NODES = 6
PROMPTS = ["a b a b a b a b a b a", "The cat sat on the mat. The cat sat on the", "1, 2, 3, 1, 2, 3, 1, 2"]


@pytest.fixture(scope="module", params=["standard", "ort-gqa"])
def pipe(request, tiny_engines):
    from specexport.runtime import load

    engines = tiny_engines.get("llama", drafters=("ngram",), attention=request.param, tree_nodes=NODES, **TINY_SHAPE)
    return load(engines, threads=2)


class DecoyTreeDrafter(Stateless):
    """Knows the target's greedy continuation and hides it: at each level a decoy first, the
    true token second, the next level under the true one. The accepted path is rows 2, 4, 6."""

    name = "decoy-tree"

    def __init__(self, prompt_len: int, continuation: list[int], vocab: int):
        self.prompt_len, self.continuation, self.vocab = prompt_len, continuation, vocab

    def propose_tree(self, row, depth, nodes, top_k):
        done = len(row.context) - self.prompt_len
        truth = self.continuation[done : done + depth]
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

    def commit(self, length, path):
        if not self.in_place:
            for name, array in self.cache.view().items():
                array[:, :, length : length + 1 + len(path)] = self._presents[name][:, :, : 1 + len(path)]
        self.cache.set_length(min(length, self.cache.length))
        self.cache.advance(length + 1 + len(path) - self.cache.length)


def decode_with(pipe, drafter, ids, max_new, verifier_class=TreeVerifier):
    target = pipe.batched_target(1)
    base = pipe.tree_verifier(target)
    verifier = verifier_class(base.engines, pipe.manifest.engines_of("target", "onnxruntime", tree=True)[-1],
                              target.runners[0].cache)
    out: list[int] = []
    loop = BatchLoop(target, drafter, draft_len=pipe.manifest.draft_len, eos_ids=frozenset(),
                     on_token=lambda key, token: out.append(token), tree=verifier, tree_nodes=NODES)
    request, _ = pipe.batch_request(ids, max_new_tokens=max_new)
    loop.submit(0, request)
    finished = []
    while loop.busy:
        finished += loop.step()
    return out, finished[0][1].stats


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ngram_tree_equals_the_target_alone(pipe, prompt):
    ids = pipe.prompt_ids(prompt)
    want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=48).token_ids
    got = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=NODES)
    assert got.token_ids == want
    assert got.stats.tree_nodes > 0  # trees were verified, not only chains
    chain = pipe.generate(prompt_ids=ids, drafter="ngram", max_new_tokens=48, tree_nodes=0)
    assert chain.token_ids == want and chain.stats.tree_nodes == 0


def test_a_hidden_path_is_accepted_and_the_cache_compacted(pipe):
    ids = pipe.prompt_ids(PROMPTS[1])
    want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=40).token_ids
    drafter = DecoyTreeDrafter(len(ids), want, pipe.manifest.models["target"].vocab_size)
    got, stats = decode_with(pipe, drafter, ids, 40)
    assert got == want
    assert stats.acceptance_length > 2.5  # three levels of true tokens behind decoys: most rounds take them all


def test_skipping_compaction_is_caught(pipe):
    ids = pipe.prompt_ids(PROMPTS[1])
    want = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=40).token_ids
    drafter = DecoyTreeDrafter(len(ids), want, pipe.manifest.models["target"].vocab_size)
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


def test_a_batched_loop_switches_between_chains_and_trees(tiny_engines):
    # two sequences decode chains together; once one ends, the other (slot 0 of a batched cache)
    # goes on with trees; both equal the target alone
    from specexport.runtime import load

    engines = tiny_engines.get("llama", drafters=("ngram",), attention="ort-gqa", batch=(1, 2), tree_nodes=NODES,
                               **TINY_SHAPE)
    pipe = load(engines, threads=2)
    ids = [pipe.prompt_ids(PROMPTS[1]), pipe.prompt_ids(PROMPTS[2])]
    want = [pipe.generate(prompt_ids=i, drafter="none", max_new_tokens=n).token_ids for i, n in zip(ids, (48, 12))]
    out: dict[int, list[int]] = {0: [], 1: []}
    loop = pipe.batch_loop(drafter="ngram", max_batch=2, tree_nodes=NODES,
                           on_token=lambda key, token: out[key].append(token))
    for key, (prompt, n) in enumerate(zip(ids, (48, 12))):
        loop.submit(key, pipe.batch_request(prompt, max_new_tokens=n)[0])
    finished = {}
    while loop.busy:
        finished.update(loop.step())
    assert [out[0], out[1]] == want
    assert finished[0].stats.tree_nodes > 0 and finished[1].stats.tree_nodes == 0
