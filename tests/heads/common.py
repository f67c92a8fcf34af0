"""Shared helpers of the head tests: a build (whole, or of one head alone: what a broken
loader must fail), parity figures, losslessness, sampling (chain heads), and the checkpoint
edits and broken loaders the block-head tests share."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.lossless import (
    assert_each_position_sampled_as_target,
    assert_lossless,
    exact_sequence_probs,
    use_rule,
)

SHAPES = {"batch": 1, "max_seq_len": 48, "prefill_chunk": 8}
PROMPTS = ["The lighthouse keeper", "def merge(a, b):\n    return", "1, 2, 3, 4,"]


def with_shapes(recipe: dict) -> dict:
    """``recipe`` with the head tests' SHAPES and draft depth where it gives none."""
    return {"shapes": SHAPES, "draft": {"max_draft": 3}, **recipe}


def build(recipe: dict, base: Path, out: Path) -> Path:
    from specexport.exporter.builder import build_recipe
    from specexport.exporter.recipe import parse_recipe
    from specexport.progress import Reporter

    build_recipe(parse_recipe(with_shapes(recipe), "recipe"), base, out, False, Reporter(quiet=True))
    return out


def build_head_only(raw: dict, base: Path, tmp: Path):
    """Load the recipe's one head and run its build (export, parity, registration) without
    exporting the target: what a loader mistake must fail. Returns the builder."""
    from specexport.exporter.builder import Builder
    from specexport.exporter.heads import HeadContext, load_head
    from specexport.exporter.recipe import parse_recipe
    from specexport.exporter.sources import load_source
    from specexport.progress import Reporter

    parsed = parse_recipe(with_shapes(raw), "recipe")
    builder = Builder(parsed, base, tmp / "out", Reporter(quiet=True))
    target = load_source(parsed.target, base, "target")
    spec = parsed.drafters[0]
    head = load_head(spec, target, base, "drafters.0")
    tmp.mkdir(parents=True, exist_ok=True)
    head.build(HeadContext(builder, tmp, spec.name, builder.plan(target), target, tuple(sorted(head.taps)),
                           builder.threads,  # the whole build's threads: the shared onnxruntime pool's
                           precision=getattr(spec, "precision", "fp32")))
    return builder


def head_parity(engines: Path, model: str) -> dict[str, dict]:
    manifest = json.loads((engines / "manifest.json").read_text())
    return {e["name"]: e["parity"] for e in manifest["engines"] if e["model"] == model}


def check_parity(engines: Path, model: str) -> None:
    """Every graph of the head within the reference's limits; its fill graph (ort-gqa builds,
    exporter/fill.py), at each catch-up and prefill size, leaves the cache as its catch-up graph does."""
    figures = head_parity(engines, model)
    fills = {name: p for name, p in figures.items() if name.split(".")[1] == "fill"}
    figures = {name: p for name, p in figures.items() if name not in fills}
    assert {name.split(".")[1] for name in figures} == {"catchup", "prefill", "step"}, figures
    for name, p in figures.items():
        assert p["enforced"] and p["positions"] >= 3, (name, p)
        assert p["max_rel_logit_diff"] <= 1e-4 and p["argmax_agreement"] == 1.0, (name, p)
    if fills:
        size = {name: name.rsplit(".t", 1)[1] for name in {*figures, *fills}}
        assert {size[n] for n in fills} == {size[n] for n in figures if n.split(".")[1] != "step"}, fills
    for name, p in fills.items():
        assert p["cache_equal_to_full_graph"] is True and p["tested"], (name, p)


def check_greedy_lossless(pipe, drafter: str, max_new_tokens: int = 20, prompts: list[str] = PROMPTS) -> None:
    """Lossless on ``pipe``; and the same directory with its caches (the head's too) in the
    device store on the CPU (runtime/device_store.py) decodes the very same tokens."""
    from specexport.runtime import load

    on_device = None if pipe.options.device_store else load(pipe.manifest.root, threads=pipe.options.threads,
                                                            backend=pipe.backend, device_store=True)
    for prompt in prompts:
        ids = pipe.prompt_ids(prompt)
        base = pipe.generate(prompt_ids=ids, max_new_tokens=max_new_tokens).token_ids
        # every round drafts: a tiny head costs about what its tiny target does, so adaptive
        # depth may rightly choose not to draft, and this is about what the drafts do
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, drafter=drafter, adaptive=False)
        assert spec.stats.proposed > 0, "the head never drafted"
        assert_lossless(pipe, ids, base, spec.token_ids, f"{drafter} on {prompt!r}")
        if on_device is not None:
            again = on_device.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, drafter=drafter, adaptive=False)
            assert (again.token_ids, again.stats.accepted) == (spec.token_ids, spec.stats.accepted), \
                f"{drafter} on {prompt!r} through the device store"


def check_sampling(pipe, drafter: str, monkeypatch, rule=None, draws: int = 500) -> None:
    """Two sampled tokens with the head drafting, at a flat warp (T = 3, the whole vocabulary) so
    that the random head's q overlaps the target's p and drafts are sometimes kept: each token is
    distributed as the target's warped p under the right rule (``rule`` None); under a wrong
    ``rule`` (the failing control) the same draws fail."""
    from specexport.runtime.acceptance import Sampling

    sampling = Sampling(temperature=3.0)
    ids = pipe.prompt_ids("1, 2, 1, 2, 1,")
    exact = exact_sequence_probs(pipe, ids, sampling, 2)
    use_rule(monkeypatch, rule)
    counts: dict[tuple[int, ...], int] = {}
    proposed = accepted = 0
    for seed in range(draws):
        out = pipe.generate(prompt_ids=ids, drafter=drafter, max_new_tokens=2, temperature=3.0, seed=seed,
                            adaptive=False)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        proposed += out.stats.proposed
        accepted += out.stats.accepted
    if rule is None:
        assert set(counts) <= set(exact), f"{set(counts) - set(exact)} are outside the target's support"
        assert proposed > accepted > 0, "drafts were not both kept and rejected"
    # 259² two-token sequences: too many to fill, so each position on its own
    assert_each_position_sampled_as_target(counts, exact, draws, right_rule=rule is None)


# -- checkpoint edits and loader mistakes (block heads' malformed and broken-loader tests) ------


def drop_tensor(name: str):
    """A folder edit removing tensor ``name`` from model.safetensors."""
    def change(folder: Path):
        tensors = load_file(str(folder / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(folder / "model.safetensors"))
    return change


def edit_config(edit):
    """A folder edit applying ``edit(config)`` to config.json."""
    def change(folder: Path):
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return change


def patch_layout(monkeypatch, layouts: dict, layout: str, change) -> None:
    """Make ``layouts[layout]``'s reader wrong on purpose: ``change(facts)`` after reading."""
    recognise, read = layouts[layout]

    def wrong(ckpt, override):
        facts = read(ckpt, override)
        change(facts)
        return facts

    monkeypatch.setitem(layouts, layout, (recognise, wrong))
