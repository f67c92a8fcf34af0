import numpy as np

from specexport.runtime.acceptance import Sampling
from specexport.runtime.drafters import DraftBudget, DraftRow, ModelDrafter, NgramDrafter
from specexport.runtime.kv_cache import KVCache
from tests.runtime.fakes import markov, random_table

RNG = np.random.default_rng(0)
GREEDY = Sampling()


def propose(drafter, context, k, sampling=GREEDY, rng=RNG):
    """The drafter's proposal for one row (slot 0)."""
    return drafter.propose([DraftRow(np.array(context, dtype=np.int64), sampling, rng)], DraftBudget([k]))[0]


def proposed(drafter, context, k):
    return propose(drafter, context, k).tokens.tolist()


def test_ngram_longest_match_first():
    # "7 8 9" matches earlier in full (-> 1 2); the bare suffix "9" alone matches elsewhere (-> 5)
    context = [9, 5, 5, 7, 8, 9, 1, 2, 3, 0, 7, 8, 9]
    assert proposed(NgramDrafter(max_ngram=3), context, 2) == [1, 2]
    assert proposed(NgramDrafter(max_ngram=1), context, 2) == [1, 2]  # latest "9" with 2 tokens after


def test_ngram_a_long_match_tells_copies_apart():
    # a code edit copying its prompt: the last three tokens ("1 2 3", say " self.") follow three
    # names (10, 11, 12), each with its own continuation; the copy so far ends "10 1 2 3", which
    # occurs once: the default follows it, where a 3-token lookup takes the latest "1 2 3"
    context = [10, 1, 2, 3, 20, 11, 1, 2, 3, 21, 12, 1, 2, 3, 22, 0, 10, 1, 2, 3]
    draft = propose(NgramDrafter(), context, 2)
    assert (draft.tokens.tolist(), draft.tag) == ([20, 11], "ngram/n4")
    assert proposed(NgramDrafter(max_ngram=3), context, 2) == [22, 0]


def test_ngram_tags_bucket_the_match_length():
    copy = list(range(1, 15))  # 14 distinct tokens
    for matched, tag in [(1, "ngram/n1"), (5, "ngram/n4"), (7, "ngram/n6"), (13, "ngram/n12")]:
        context = copy + [0] + copy[:matched]
        assert propose(NgramDrafter(), context, 1).tag == tag, matched
    assert propose(NgramDrafter(max_ngram=5), copy + [0] + copy[:13], 1).tag == "ngram/n4"  # capped


def reference_chain(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup spelled out: the longest n whose last n tokens occur earlier, the latest
    occurrence with k tokens after it (else the earliest)."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        starts = [i + n for i in range(len(context) - n) if context[i : i + n] == context[-n:]]
        if starts:
            full = [s for s in starts if s + k <= len(context)]
            start = full[-1] if full else starts[0]
            return context[start : start + k]
    return []


def test_ngram_chains_match_the_lookup_spelled_out():
    rng = np.random.default_rng(3)
    for _ in range(300):  # three tokens, so matches are many and some run long
        context = rng.integers(0, 3, size=int(rng.integers(1, 40))).tolist()
        min_ngram = int(rng.integers(1, 4))
        max_ngram, k = int(rng.integers(min_ngram, 20)), int(rng.integers(1, 8))
        drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        assert proposed(drafter, context, k) == reference_chain(context, k, max_ngram, min_ngram), (context, k)


def ngram_tree(drafter, context, depth, nodes, top_k):
    """The drafter's tree for one row: (tokens, parents, weights to 4 places)."""
    tree = drafter.propose([DraftRow(np.array(context, dtype=np.int64), GREEDY, RNG)], DraftBudget([depth], nodes, top_k))[0]
    return tree.tokens.tolist(), tree.parents.tolist(), np.round(tree.weights, 4).tolist()


def test_ngram_tree_merges_what_followed_every_match_into_a_trie():
    # "3 1" matched at 8, 4 and 0 (latest first: "4 2 2", "5 9 3", "4 9 3", each weighing 4),
    # then "1" alone (the same three continuations, weighing 1 each): "4" carries 10 of 15, "5"
    # 5; under "4", "4 2" and "4 9" tie at 5 and the earlier continuation's comes first
    context = [3, 1, 4, 9, 3, 1, 5, 9, 3, 1, 4, 2, 2, 3, 1]
    assert ngram_tree(NgramDrafter(max_ngram=3), context, 3, 5, 2) == (
        [4, 2, 2, 5, 9], [-1, 0, 1, -1, 3], [0.6667, 0.3333, 0.3333, 0.3333, 0.3333])
    # the chain follows the longest match's latest occurrence: the tree's heaviest path
    assert proposed(NgramDrafter(max_ngram=3), context, 3) == [4, 2, 2]


def test_a_longer_match_outranks_more_numerous_shorter_ones():
    # "5 6 7" occurred once, then "1 8 7"; the last token "7" alone is followed by "2" four
    # times. Counted once each, "2" would lead the tree; the long match is the better guess (the
    # chain takes it): it weighs 16 + 4 + 1 of 25
    context = [5, 6, 7, 1, 8, 7, 2, 8, 7, 2, 8, 7, 2, 8, 7, 2, 5, 6, 7]
    assert ngram_tree(NgramDrafter(max_ngram=3), context, 3, 4, 2) == ([1, 8, 7, 2], [-1, 0, 1, -1], [0.84, 0.84, 0.84, 0.16])
    assert proposed(NgramDrafter(max_ngram=3), context, 3) == [1, 8, 7]


def test_ngram_prefers_the_latest_match_with_k_tokens_after():
    context = [4, 1, 2, 4, 3, 3, 4, 6, 4]
    assert proposed(NgramDrafter(max_ngram=1), context, 2) == [6, 4]
    assert proposed(NgramDrafter(max_ngram=1), context, 5) == [3, 3, 4, 6, 4]
    # no occurrence has 6 tokens after it: take the longest continuation (the earliest)
    assert proposed(NgramDrafter(max_ngram=1), context, 6) == [1, 2, 4, 3, 3, 4]


def test_ngram_no_match_proposes_nothing():
    assert proposed(NgramDrafter(max_ngram=3, min_ngram=2), [1, 2, 3, 4, 5], 4) == []
    assert proposed(NgramDrafter(), [7], 4) == []


def test_ngram_min_size_is_respected():
    context = [1, 2, 3, 9, 3]  # only a 1-gram match ("3")
    assert proposed(NgramDrafter(max_ngram=3, min_ngram=2), context, 2) == []
    assert proposed(NgramDrafter(max_ngram=3, min_ngram=1), context, 2) == [9, 3]


def test_model_drafter_resyncs_after_partial_acceptance():
    table = random_table(5, seed=1)
    model = markov(table)
    runner = model.runners[0]
    drafter = ModelDrafter("m", model, {})
    prompt = np.array([1, 2, 3])
    drafter.join(0, prompt, {})
    assert runner.fed == []  # the prompt waits for the loop's prefill, or the first draft
    drafter.prefill(0)
    assert runner.fed == [1, 2]
    draft = proposed(drafter, prompt, 4)
    # fed the last prompt token, then drafts 1..3 (the 4th is never fed)
    assert runner.fed == [1, 2, 3, *draft[:3]]
    drafter.accept(0, 1, 4, {})  # target kept draft 1, then chose token 4
    context = np.array([1, 2, 3, draft[0], 4])
    drafter.propose([DraftRow(context, Sampling(), RNG)], DraftBudget([2]))
    # the rejected drafts were dropped: the row resumed after draft 1
    assert runner.fed[:5] == context.tolist()


def test_kv_cache_write_and_rewind_reuse_the_same_buffers():
    cache = KVCache(num_layers=2, batch=1, num_kv_heads=2, max_seq_len=8, head_dim=4)
    buffers = {k: id(v) for k, v in cache.view().items()}
    present = {f"present.{i}.{kind}": np.full((1, 2, 3, 4), i + 1.0, dtype=np.float32)
               for i in range(2) for kind in ("key", "value")}
    cache.write(present, 3)
    cache.rewind(1)
    cache.write(present, 2)
    assert cache.length == 3
    assert {k: id(v) for k, v in cache.view().items()} == buffers
    assert (cache.view()["past_key_values.1.value"][:, :, :3] == 2.0).all()
    assert (cache.view()["past_key_values.1.value"][:, :, 4:] == 0.0).all()


def test_kv_cache_refuses_overflow_and_forward_rewind():
    import pytest

    cache = KVCache(1, 1, 1, 4, 2)
    present = {f"present.0.{k}": np.zeros((1, 1, 5, 2), np.float32) for k in ("key", "value")}
    with pytest.raises(ValueError):
        cache.write(present, 5)
    with pytest.raises(ValueError):
        cache.rewind(1)


def test_sampled_model_drafter_keeps_only_the_warped_rows_it_drew_from():
    from specexport.runtime.acceptance import Kept, warp_reference

    table = random_table(7, seed=3)
    drafter = ModelDrafter("m", markov(table), {})
    prompt = np.array([1, 2])
    drafter.join(0, prompt, {})
    sampling = Sampling(0.9, top_k=4, top_p=0.8)
    draft = propose(drafter, prompt, 3, sampling, np.random.default_rng(1))
    assert len(draft.probs) == 3 and all(isinstance(q, Kept) for q in draft.probs)  # no [k, V] array
    previous = [2, *draft.tokens[:2].tolist()]
    for q, token, last in zip(draft.probs, draft.tokens.tolist(), previous):
        np.testing.assert_allclose(q.dense(7), warp_reference(table[[last]], sampling)[0], rtol=1e-5, atol=1e-12)
        assert q.prob(token) > 0  # each draft came from its row


def test_a_kinds_drafter_is_made_by_the_factory_its_registry_entry_names():
    from specexport.contract import DrafterEntry
    from specexport.runtime.drafter_factories import make_drafter

    entry = DrafterEntry("lookup", "ngram", None, {"max_ngram": 5, "min_ngram": 2})
    drafter = make_drafter(None, entry, slots=1)  # type: ignore[arg-type]  # prompt lookup opens no model
    assert isinstance(drafter, NgramDrafter)
    assert (drafter.name, drafter.max_ngram, drafter.min_ngram) == ("lookup", 5, 2)
