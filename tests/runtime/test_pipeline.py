"""The runtime over real (tiny) engine directories: losslessness, stops, sampling, the CLI."""

import json

import pytest

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling
from tests.conftest import LOSSLESS_PAIRS, TINY_SHAPE, copy_engines, lossless_drafters, run_cli
from tests.lossless import (
    assert_lossless,
    assert_sampled_as_target,
    exact_sequence_probs,
    residual_is_q,
    residual_keeps_the_rejected_token,
    rules,
    sample_counts,
    target_margin_at,
    use_rule,
)

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time",
]


@pytest.mark.parametrize("store", ["host", "device"])
@pytest.mark.parametrize("arch, attention", LOSSLESS_PAIRS)
def test_greedy_lossless_for_every_drafter(tiny_engines, arch, attention, store):
    # the session's one build of the pair, whose parity tests/exporter/test_archs.py checks
    # (the draft model, a tiny llama, runs beside the llama targets: conftest.lossless_drafters);
    # "device": the caches in the device store on the CPU (runtime/device_store.py)
    pipe = load(tiny_engines.for_arch(arch, attention), device_store=store == "device")
    drafters = lossless_drafters(arch)
    assert "quantized-self" in drafters and ("draft-model" in drafters) == (arch == "llama")
    assert set(pipe.drafter_names) == {"none", *drafters}
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        baseline = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=64)
        assert baseline.stats.acceptance_length == 1.0
        for drafter in drafters:
            result = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=64)
            assert_lossless(pipe, ids, baseline.token_ids, result.token_ids,
                            f"{arch}/{attention}/{drafter}/{prompt[:12]!r}")


def test_speculation_actually_happens(tiny_engines):
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    ids = pipe.prompt_ids(PROMPTS[2])
    result = pipe.generate(prompt_ids=ids, drafter="quantized-self", max_new_tokens=48, adaptive=False)
    assert result.stats.proposed_at[0] >= result.stats.rounds - 1  # fixed depth: every round drafts
    assert result.stats.accepted > 0 and result.stats.acceptance_length > 1.0
    assert result.stats.rounds < 48


def test_near_tie_check_can_fail(tiny_engines):
    # A made-up divergence at a position with a clear margin must be reported.
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    ids = pipe.prompt_ids(PROMPTS[0])
    baseline = pipe.generate(prompt_ids=ids, max_new_tokens=8).token_ids
    forged = [*baseline[:3], (baseline[3] + 1) % 259, *baseline[4:]]
    assert target_margin_at(pipe, ids, baseline[:3]) > 1e-3
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_lossless(pipe, ids, baseline, forged, "forged")


def test_stop_strings_cut_the_text(tiny_engines):
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    full = pipe.generate(PROMPTS[3], max_new_tokens=40)
    stop = full.text[10:13]
    assert len(stop) == 3
    for drafter in ("none", "ngram", "draft-model"):
        cut = pipe.generate(PROMPTS[3], max_new_tokens=40, stop=[stop], drafter=drafter)
        assert cut.stop_reason == "stop_string"
        assert cut.text == full.text[: full.text.index(stop)]
        assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
        streamed = "".join(pipe.stream(PROMPTS[3], max_new_tokens=40, stop=[stop], drafter=drafter))
        assert streamed == cut.text


@pytest.mark.parametrize("attention", ["standard", "ort-gqa"])
def test_eos_and_max_new_tokens_and_kv_full(tiny_engines, attention, tmp_path):
    engines = tiny_engines.get("llama", attention=attention, **TINY_SHAPE)
    pipe = load(engines)
    result = pipe.generate(PROMPTS[3], max_new_tokens=5, drafter="draft-model")
    assert len(result.token_ids) == 5 and result.stop_reason == "max_new_tokens"
    ids = pipe.prompt_ids("x" * 150)
    full = pipe.generate(prompt_ids=ids, max_new_tokens=100, drafter="ngram")
    assert full.stop_reason == "kv_full" and len(ids) + len(full.token_ids) == 161

    # An EOS stops generation right after it. A random model rarely emits the real EOS, so a
    # copy of the engines declares as EOS a token the target surely emits, for the first time
    # a few tokens in: every drafter must stop exactly there.
    ids = pipe.prompt_ids(PROMPTS[1])
    baseline = pipe.generate(prompt_ids=ids, max_new_tokens=40).token_ids
    first = next(i for i in range(4, len(baseline)) if baseline[i] not in baseline[:i])
    copy = tmp_path / "eos-engines"
    copy_engines(engines, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["eos_token_ids"] = [baseline[first]]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    eos_pipe = load(copy)
    for drafter in ("none", "ngram", "quantized-self", "draft-model"):
        stopped = eos_pipe.generate(prompt_ids=ids, max_new_tokens=40, drafter=drafter)
        assert stopped.stop_reason == "eos", drafter
        assert stopped.token_ids == baseline[: first + 1], drafter


# (drafter, prompt, the wrong rule of the control): prompts where the drafts are sometimes kept
# (the n-gram guesses "l", to which the target's warped p gives about 0.3; at top-k 8 the draft
# model's q overlaps p). For the n-gram's point mass the wrong rule forgets to remove the
# rejected token from p. With no drafter there is no acceptance rule to get wrong: no control.
SINGLE_SAMPLED = [("none", "1, 2, 1, 2, 1, 2, 1,", None),
                  ("ngram", "hello hello hello hel", residual_keeps_the_rejected_token),
                  ("quantized-self", "1, 2, 1, 2, 1, 2, 1,", residual_is_q),
                  ("draft-model", "1, 2, 1, 2, 1, 2, 1,", residual_is_q)]


@pytest.mark.parametrize("drafter, prompt, rule", [
    *[pytest.param(d, prompt, None, id=f"{d}-right-rule") for d, prompt, _ in SINGLE_SAMPLED],
    *[pytest.param(d, prompt, wrong, id=f"{d}-control") for d, prompt, wrong in SINGLE_SAMPLED if wrong]])
def test_sampled_tokens_follow_the_target_with_real_engines(tiny_engines, drafter, prompt, rule, monkeypatch):
    """Two sampled tokens, every drafter: distributed as the target alone samples them. The
    control: the same draws under a wrong rule must fail."""
    pipe = load(tiny_engines.get("llama", attention="ort-gqa", **TINY_SHAPE))
    sampling = Sampling(temperature=1.5, top_k=8, top_p=0.95)
    ids = pipe.prompt_ids(prompt)
    exact = exact_sequence_probs(pipe, ids, sampling, 2)
    use_rule(monkeypatch, rule)
    draws = 1200
    # at the full depth every round: the rule under test, not adaptive depth, decides what is kept
    counts, stats = sample_counts(pipe, ids, draws, drafter=drafter, max_new_tokens=2, temperature=1.5, top_k=8,
                                  top_p=0.95, adaptive=False)
    accepted = sum(s.accepted for s in stats)
    if rule is None:
        assert set(counts) <= set(exact), f"{set(counts) - set(exact)} are outside the target's top-k/top-p support"
        assert accepted > 0 or drafter == "none", "no draft was ever kept: the test would not exercise acceptance"
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


@pytest.mark.parametrize("rule", rules(residual_is_q))
def test_sampling_with_mostly_accepted_drafts_follows_the_target(near_copy_engines, rule, monkeypatch):
    """Real engines, D = 3 drafts a round: rounds that keep all three and add the bonus token,
    and rounds that reject after two accepted, must both happen, and the four tokens must be
    distributed exactly as the target alone samples them. The control: the same draws with the
    replacement token drawn from q, not max(0, p − q), must fail."""
    pipe = load(near_copy_engines)
    depth, draws = 3, 1500
    sampling = Sampling(temperature=1.5, top_k=3, top_p=0.95)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    exact = exact_sequence_probs(pipe, ids, sampling, depth + 1)  # [4-token sequence] -> p
    use_rule(monkeypatch, rule)
    counts: dict[tuple, int] = {}
    all_kept = rejected_after_two = 0
    for seed in range(draws):
        out = pipe.generate(prompt_ids=ids, drafter="near-copy", max_new_tokens=depth + 1, draft_len=depth,
                            adaptive=False, temperature=1.5, top_k=3, top_p=0.95, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        # With max_new_tokens = D+1, round one offers D drafts and any later round fewer
        # (k <= tokens left - 1), so only round one can offer position D-1: it kept all three
        # (and the fourth token is the bonus) iff accepted_at[2] == 1. It kept two and
        # rejected the third iff then no further round offered anything.
        stats = out.stats
        all_kept += stats.accepted_at[depth - 1]
        rejected_after_two += stats.proposed_at == [1, 1, 1] and stats.accepted_at == [1, 1, 0]
    if rule is None:
        outside = [s for s in counts if s not in exact]
        assert not outside, f"{outside} are outside the target's top-k/top-p support"
        assert all_kept > draws / 2, f"drafts were not mostly accepted: {all_kept} of {draws} rounds kept all"
        assert rejected_after_two > 0, "no round rejected a draft after accepting two"
    assert_sampled_as_target(counts, exact, draws, right_rule=rule is None)


def test_seeded_sampling_is_reproducible(tiny_engines):
    # the prices as built: a seed repeats its draws when the depths repeat (--fixed-prices), and
    # prices checked against the clock may choose other depths on another run
    pipe = load(tiny_engines.get("llama", **TINY_SHAPE), check_prices=False)
    kwargs = dict(max_new_tokens=30, temperature=1.0, top_p=0.9, drafter="draft-model")
    a = pipe.generate(PROMPTS[1], seed=1, **kwargs).token_ids
    assert a == pipe.generate(PROMPTS[1], seed=1, **kwargs).token_ids
    assert a != pipe.generate(PROMPTS[1], seed=2, **kwargs).token_ids


def test_chat_template_matches_transformers(tiny_engines):
    from specexport.exporter.tiny import byte_tokenizer

    pipe = load(tiny_engines.get("llama", **TINY_SHAPE))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld!"}]
    expected = byte_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert pipe.prompt_ids(messages=messages) == list(expected["input_ids"])


def test_generate_cli_json_same_ids_for_every_drafter(tiny_engines):
    engines = tiny_engines.get("llama", **TINY_SHAPE)
    results = {}
    for drafter in ("none", "ngram", "quantized-self"):
        code, out, err = run_cli("generate", engines, "--prompt", PROMPTS[1], "--chat", "--drafter", drafter,
                                 "-n", "32", "--json")
        assert code == 0, err
        results[drafter] = json.loads(out)
    assert results["ngram"]["token_ids"] == results["none"]["token_ids"]
    pipe = load(engines)
    ids = pipe.prompt_ids(PROMPTS[1], chat=True)
    assert_lossless(pipe, ids, results["none"]["token_ids"], results["quantized-self"]["token_ids"],
                    "cli/quantized-self")
    stats = results["ngram"]["stats"]
    for key in ("acceptance_length", "draft_s", "verify_s", "host_s", "rounds", "acceptance_by_position"):
        assert key in stats
    assert results["none"]["stop_reason"] in ("eos", "max_new_tokens")


def test_generate_cli_stream_and_prompt_file(tiny_engines, tmp_path):
    engines = tiny_engines.get("llama", **TINY_SHAPE)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPTS[1])
    code, streamed, err = run_cli("generate", engines, "--prompt-file", prompt, "--stream", "-n", "20")
    assert code == 0 and "tok/s" in err
    code, plain, _ = run_cli("generate", engines, "--prompt", PROMPTS[1], "-n", "20")
    assert code == 0 and streamed == plain


def test_python_api_in_three_lines(tiny_engines):
    from specexport.runtime import load as load_engines

    pipe = load_engines(tiny_engines.get("llama", **TINY_SHAPE))
    result = pipe.generate("Once upon a time", drafter="ngram", max_new_tokens=10)
    # the text is the detokenized output, which is the target alone's
    assert result.token_ids == pipe.generate("Once upon a time", max_new_tokens=10).token_ids
    assert len(result.token_ids) == 10 and result.stop_reason == "max_new_tokens"
    # the streaming detokenizer holds back a trailing incomplete UTF-8 sequence (random bytes
    # here), which a full decode shows as U+FFFD: apart from that, the same text
    full = pipe.text.decode(result.token_ids)
    assert result.text and full.startswith(result.text), (result.text, full)
    assert set(full[len(result.text):]) <= {"\ufffd"}, (result.text, full)
