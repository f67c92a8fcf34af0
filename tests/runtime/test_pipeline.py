"""The runtime over real (tiny) engine directories: losslessness, stops, sampling, the CLI."""

import json

import numpy as np
import pytest

from specexport.runtime import load
from specexport.runtime.acceptance import Sampling, warp
from tests.conftest import run_cli
from tests.lossless import assert_lossless, target_margin_at

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time",
]
SHAPE = dict(max_seq_len=160, prefill_chunk=16)


@pytest.mark.parametrize("arch, attention", [("llama", "standard"), ("qwen3", "standard"), ("gemma2", "standard"),
                                             ("phi3", "standard"), ("llama", "ort-gqa"), ("gemma2", "ort-gqa")])
def test_greedy_lossless_for_every_drafter(tiny_engines, arch, attention):
    pipe = load(tiny_engines.get(arch, attention=attention, **SHAPE))
    assert set(pipe.drafter_names) == {"none", "ngram", "quantized-self", "draft-model"}
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        baseline = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=64)
        assert baseline.stats.acceptance_length == 1.0
        for drafter in ("ngram", "quantized-self", "draft-model"):
            result = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=64)
            assert_lossless(pipe, ids, baseline.token_ids, result.token_ids,
                            f"{arch}/{attention}/{drafter}/{prompt[:12]!r}")


def test_speculation_actually_happens(tiny_engines):
    pipe = load(tiny_engines.get("llama", **SHAPE))
    ids = pipe.prompt_ids(PROMPTS[2])
    result = pipe.generate(prompt_ids=ids, drafter="quantized-self", max_new_tokens=48, adaptive=False)
    assert result.stats.proposed_at[0] >= result.stats.rounds - 1  # fixed depth: every round drafts
    assert result.stats.accepted > 0 and result.stats.acceptance_length > 1.0
    assert result.stats.rounds < 48


def test_near_tie_check_can_fail(tiny_engines):
    # A made-up divergence at a position with a clear margin must be reported.
    pipe = load(tiny_engines.get("llama", **SHAPE))
    ids = pipe.prompt_ids(PROMPTS[0])
    baseline = pipe.generate(prompt_ids=ids, max_new_tokens=8).token_ids
    forged = [*baseline[:3], (baseline[3] + 1) % 259, *baseline[4:]]
    assert target_margin_at(pipe, ids, baseline[:3]) > 1e-3
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_lossless(pipe, ids, baseline, forged, "forged")


def test_stop_strings_cut_the_text(tiny_engines):
    pipe = load(tiny_engines.get("llama", **SHAPE))
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
def test_eos_and_max_new_tokens_and_kv_full(tiny_engines, attention):
    pipe = load(tiny_engines.get("llama", attention=attention, **SHAPE))
    result = pipe.generate(PROMPTS[3], max_new_tokens=5, drafter="draft-model")
    assert len(result.token_ids) == 5 and result.stop_reason == "max_new_tokens"
    ids = pipe.prompt_ids("x" * 150)
    full = pipe.generate(prompt_ids=ids, max_new_tokens=100, drafter="ngram")
    assert full.stop_reason == "kv_full" and len(ids) + len(full.token_ids) == 161
    # an EOS in the output stops generation right after it
    eos = next(iter(pipe.text.eos_ids))
    long_run = pipe.generate(prompt_ids=ids[:40], max_new_tokens=100).token_ids
    if eos in long_run:
        assert long_run[-1] == eos


def _warped(pipe, ids, sampling):
    runner = pipe.target
    runner.rewind(0)
    return warp(runner.forward(np.asarray(ids, dtype=np.int64), want_logits=True).logits[-1:], sampling)[0]


@pytest.mark.parametrize("drafter", ["none", "ngram", "quantized-self", "draft-model"])
def test_sampled_tokens_follow_the_target_with_real_engines(tiny_engines, drafter):
    pipe = load(tiny_engines.get("llama", attention="ort-gqa", **SHAPE))
    sampling = Sampling(temperature=1.5, top_k=3, top_p=0.95)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1, 2, 1,")
    p1 = _warped(pipe, ids, sampling)
    exact = {}
    for a in np.flatnonzero(p1):
        p2 = _warped(pipe, [*ids, int(a)], sampling)
        for b in np.flatnonzero(p2):
            exact[(int(a), int(b))] = p1[a] * p2[b]
    draws = 1200
    counts = dict.fromkeys(exact, 0)
    for seed in range(draws):
        out = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=2, temperature=1.5, top_k=3,
                            top_p=0.95, seed=seed).token_ids
        assert tuple(out) in counts, f"{out} is outside the target's top-k/top-p support"
        counts[tuple(out)] += 1
    chi2 = sum((counts[s] - p * draws) ** 2 / (p * draws) for s, p in exact.items())
    df = len(exact) - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df, counts)


def test_seeded_sampling_is_reproducible(tiny_engines):
    pipe = load(tiny_engines.get("llama", **SHAPE))
    kwargs = dict(max_new_tokens=30, temperature=1.0, top_p=0.9, drafter="draft-model")
    a = pipe.generate(PROMPTS[1], seed=1, **kwargs).token_ids
    assert a == pipe.generate(PROMPTS[1], seed=1, **kwargs).token_ids
    assert a != pipe.generate(PROMPTS[1], seed=2, **kwargs).token_ids


def test_chat_template_matches_transformers(tiny_engines):
    from specexport.exporter.tiny import byte_tokenizer

    pipe = load(tiny_engines.get("llama", **SHAPE))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld!"}]
    expected = byte_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert pipe.prompt_ids(messages=messages) == list(expected["input_ids"])


def test_generate_cli_json_same_ids_for_every_drafter(tiny_engines):
    engines = tiny_engines.get("llama", **SHAPE)
    results = {}
    for drafter in ("none", "ngram", "quantized-self"):
        code, out, err = run_cli("generate", engines, "--prompt", PROMPTS[1], "--chat", "--drafter", drafter,
                                 "-n", "32", "--json")
        assert code == 0, err
        results[drafter] = json.loads(out)
    assert results["ngram"]["token_ids"] == results["none"]["token_ids"]
    stats = results["ngram"]["stats"]
    for key in ("acceptance_length", "draft_s", "verify_s", "host_s", "rounds", "acceptance_by_position"):
        assert key in stats
    assert results["none"]["stop_reason"] in ("eos", "max_new_tokens")


def test_generate_cli_stream_and_prompt_file(tiny_engines, tmp_path):
    engines = tiny_engines.get("llama", **SHAPE)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPTS[1])
    code, streamed, err = run_cli("generate", engines, "--prompt-file", prompt, "--stream", "-n", "20")
    assert code == 0 and "tok/s" in err
    code, plain, _ = run_cli("generate", engines, "--prompt", PROMPTS[1], "-n", "20")
    assert code == 0 and streamed == plain


def test_python_api_in_three_lines(tiny_engines):
    from specexport.runtime import load as load_engines

    pipe = load_engines(tiny_engines.get("llama", **SHAPE))
    text = pipe.generate("Once upon a time", drafter="ngram", max_new_tokens=10).text
    assert isinstance(text, str)
