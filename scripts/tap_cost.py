"""What the target's tapped hidden states (aux_hidden_states) cost per verify pass.

Exports the recipe's target verify graph (T = 1 + D) three times into a temporary folder, with
no taps, with EAGLE-3's default taps for the model, and with one tap (the final-normed output
MTP heads read), and times them in one interleaved schedule (each round runs every variant
once, in a rotating order, over a half-full cache, as the build times its graphs). A tapped
variant also copies aux_hidden_states out, as the decode loop asks for it when a head drafts.
Prints the median ms of each and its ratio to the untapped graph (also the median of the
per-round ratios, which a drift of the machine moves least).

Usage: .venv/bin/python scripts/tap_cost.py [RECIPE] [--draft 5] [--rounds 300] [--threads N]
       (RECIPE defaults to recipes/smollm2-135m.yaml: SmolLM2-135M, attention ort-gqa)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from specexport.contract import AUX_HIDDEN_STATES, CACHE_LENGTH, INPUT_IDS, NEXT_TOKENS
from specexport.exporter.archs import read_decoder
from specexport.exporter.graph_model import StaticDecoder
from specexport.exporter.onnx_export import WeightStore, export_graph, tensor_specs
from specexport.exporter.recipe import load_recipe
from specexport.exporter.sources import load_source
from specexport.exporter.validate import reference_ids
from specexport.runtime.engine import EngineOptions
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.ort_engine import OrtEngine

REPO = Path(__file__).resolve().parents[1]


def eagle3_default_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps when a checkpoint names none: [2, L//2, L-3] (vLLM's convention, the
    stream entering layer i = transformers' hidden_states[i])."""
    return (2, num_layers // 2, num_layers - 3)


class Variant:
    """One exported verify graph, its own cache and feeds (ids of real text)."""

    def __init__(self, label: str, taps: tuple[int, ...], engine: OrtEngine, cache: KVCache, in_place: bool,
                 ids: np.ndarray):
        self.label, self.taps, self.engine, self.cache, self.in_place = label, taps, engine, cache, in_place
        self.feeds = dict(cache.view())
        self.feeds[INPUT_IDS] = ids[None, :]  # [1, T]
        length = (cache.max_seq_len - len(ids)) // 2  # half full, as the build times graphs
        self.feeds[CACHE_LENGTH] = np.array([length], dtype=np.int64)  # [1]
        self.outputs = [NEXT_TOKENS] + ([AUX_HIDDEN_STATES] if taps else [])
        self.seconds: list[float] = []

    def run(self) -> float:
        """Seconds of one verify pass; a tapped variant's aux_hidden_states is copied out with
        the tokens (the decode loop receives those rows: the copy is part of the cost)."""
        bound = self.cache.in_place_outputs() if self.in_place else None
        start = time.perf_counter()
        self.engine.run(self.feeds, self.outputs, bound)
        return time.perf_counter() - start


def load_avg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "smollm2-135m.yaml"))
    parser.add_argument("--draft", type=int, default=5, help="D: the verify graph has T = 1 + D tokens")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: physical cores)")
    args = parser.parse_args()

    recipe, base = load_recipe(args.recipe)
    target = load_source(recipe.target, base, "target")
    seq = recipe.shapes.max_seq_len
    parts = read_decoder(target.model, seq, "target")
    layers = len(parts.layers)
    variants_taps = {"no taps": (), f"eagle3 {list(eagle3_default_taps(layers))}": eagle3_default_taps(layers),
                     f"mtp [{layers}]": (layers,)}
    tokens = 1 + args.draft
    in_place = recipe.attention == "ort-gqa"
    ids = reference_ids(target.tokenizer, tokens)  # [T]
    print(f"{recipe.name}: {layers} layers, hidden {parts.embed.shape[1]}, attention {recipe.attention}, "
          f"verify T = {tokens}, max_seq_len {seq}")

    with tempfile.TemporaryDirectory(prefix="tap-cost-") as tmp:
        store = WeightStore(Path(tmp) / "target.weights")  # the variants share every tensor
        paths = {}
        for label, taps in variants_taps.items():
            start = time.perf_counter()
            decoder = StaticDecoder(parts, seq, recipe.attention, taps=taps).eval()
            proto = export_graph(decoder, 1, tokens, recipe.opset)
            path = Path(tmp) / f"verify{len(paths)}.onnx"
            paths[label] = (path, tensor_specs(proto, "inputs"), tensor_specs(proto, "outputs"))
            store.save(proto, path)
            print(f"  exported {label}: {time.perf_counter() - start:.0f} s")
        store.close()
        options = EngineOptions(threads=args.threads)
        variants = []
        for label, taps in variants_taps.items():
            path, inputs, outputs = paths[label]
            cache = KVCache(layers, 1, parts.num_key_value_heads, seq, parts.head_dim)
            variants.append(Variant(label, taps, OrtEngine(label, path, inputs, outputs, options), cache,
                                    in_place, ids))

        print(f"timing {args.rounds} interleaved rounds; before: {load_avg()}")
        for round_ in range(args.rounds + 1):  # round 0 warms up
            shift = round_ % len(variants)  # rotate the order: no variant always runs first
            for variant in variants[shift:] + variants[:shift]:
                seconds = variant.run()
                if round_:
                    variant.seconds.append(seconds)
        print(f"after: {load_avg()}")

    base_times = np.array(variants[0].seconds)
    base_ms = float(np.median(base_times)) * 1e3
    print(f"{'variant':<22} {'median ms':>10} {'ratio':>7} {'per-round ratio':>16}")
    for v in variants:
        times = np.array(v.seconds)
        ms = float(np.median(times)) * 1e3
        paired = float(np.median(times / base_times))
        print(f"{v.label:<22} {ms:>10.3f} {ms / base_ms:>7.4f} {paired:>16.4f}")


if __name__ == "__main__":
    main()
