"""Shared helpers of the chain-head tests: a build, parity figures, losslessness, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.lossless import assert_lossless, chi_square_passes

SHAPES = {"batch": 1, "max_seq_len": 48, "prefill_chunk": 8}
PROMPTS = ["The lighthouse keeper", "def merge(a, b):\n    return", "1, 2, 3, 4,"]


def build(recipe: dict, base: Path, out: Path) -> Path:
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.progress import Reporter
    from specexport.exporter.recipe import parse_recipe

    recipe = {"shapes": SHAPES, "draft": {"max_draft": 3}, **recipe}
    build_recipe(parse_recipe(recipe, "recipe"), base, out, False, Reporter(quiet=True))
    return out


def head_parity(engines: Path, model: str) -> dict[str, dict]:
    manifest = json.loads((engines / "manifest.json").read_text())
    return {e["name"]: e["parity"] for e in manifest["engines"] if e["model"] == model}


def check_parity(engines: Path, model: str) -> None:
    figures = head_parity(engines, model)
    assert {name.split(".")[1] for name in figures} == {"catchup", "prefill", "step"}, figures
    for name, p in figures.items():
        assert p["enforced"] and p["positions"] >= 3, (name, p)
        assert p["max_rel_logit_diff"] <= 1e-4 and p["argmax_agreement"] == 1.0, (name, p)


def check_greedy_lossless(pipe, drafter: str) -> None:
    for prompt in PROMPTS:
        ids = pipe.prompt_ids(prompt)
        base = pipe.generate(prompt_ids=ids, max_new_tokens=20).token_ids
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=20, drafter=drafter)
        assert spec.stats.proposed > 0, "the head never drafted"
        assert_lossless(pipe, ids, base, spec.token_ids, f"{drafter} on {prompt!r}")


def check_sampling(pipe, drafter: str, draws: int = 500) -> None:
    """Two sampled tokens with the head drafting: distributed as the target's warped p."""
    from specexport.runtime.acceptance import Sampling, warp

    sampling = Sampling(temperature=1.5, top_k=3, top_p=0.95)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1,")

    def warped(prefix):
        pipe.target.rewind(0)
        logits = pipe.target.forward(np.asarray(prefix, dtype=np.int64), want_logits=True).logits[-1:]
        return warp(logits, sampling)[0]

    p1 = warped(ids)
    exact = {(int(a), int(b)): p1[a] * q for a in np.flatnonzero(p1)
             for b, q in ((b, warped([*ids, int(a)])[b]) for b in np.flatnonzero(warped([*ids, int(a)])))}
    counts = dict.fromkeys(exact, 0)
    proposed = 0
    for seed in range(draws):
        out = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=2, temperature=1.5, top_k=3,
                            top_p=0.95, seed=seed, adaptive=False)
        assert tuple(out.token_ids) in counts, f"{out.token_ids} is outside the target's support"
        counts[tuple(out.token_ids)] += 1
        proposed += out.stats.proposed
    assert proposed > 0
    passes, figures = chi_square_passes(counts, exact, draws)
    assert passes, figures
