"""What a drafter head's graphs cost against one target decode step, on a real target's shapes.

Each head kind in ``HEAD_KINDS`` makes random-weight heads shaped for the engine directory's
target (default: engines/smollm2-135m, SmolLM2-135M: hidden 576, 9/3 heads, head_dim 64,
intermediate 1536, vocab 49152), exports their graphs into a temporary folder and returns
runners; the target's decode graph and every head graph are then timed in one interleaved
schedule (runtime.runner.time_interleaved, as the build times its graphs), and each is printed
with its ratio to the target step.

Usage: .venv/bin/python scripts/head_costs.py [--engines DIR] [--kinds dflash ...] [--rounds 60] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))  # the repository is the specexport package


def _smollm2_like(pipe):
    """A stand-in target for a head's loader: the directory's target shapes, random embeddings."""
    import torch

    info = pipe.manifest.models["target"]
    hidden, vocab = int(info.info["hidden_size"]), int(info.vocab_size)
    embed = torch.nn.Embedding(vocab, hidden)
    torch.nn.init.normal_(embed.weight, std=0.02)
    config = SimpleNamespace(num_hidden_layers=info.num_layers, hidden_size=hidden, vocab_size=vocab,
                             num_attention_heads=int(info.info["num_attention_heads"]),
                             num_key_value_heads=info.num_kv_heads, head_dim=info.head_dim)
    return SimpleNamespace(config=config, model=SimpleNamespace(get_input_embeddings=lambda: embed,
                                                                get_output_embeddings=lambda: embed))


def dflash_runners(pipe, tmp: Path, args) -> dict:
    """1- and 2-layer z-lab DFlash heads, block 8 (7 drafts), reading 3 target layers; the graph
    of a round (C = 1+D context rows) over a half-full cache."""
    import numpy as np
    import torch

    from specexport.contract import CONTEXT_FEATURES
    from specexport.exporter.heads import dflash
    from specexport.exporter.heads.block import BlockGraph, example_inputs, graph_io
    from specexport.exporter.onnx_export import WeightStore, export_module, tensor_specs
    from specexport.exporter.recipe import DFlashDrafterSpec
    from specexport.runtime.block_drafter import BlockRunner
    from specexport.runtime.engine import EngineOptions
    from specexport.runtime.kv_cache import KVCache
    from specexport.runtime.ort_engine import OrtEngine
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the checkpoint writers of tests/heads
    from tests.heads.block_checkpoints import _write, decoder_fields, dense_tensors

    target = _smollm2_like(pipe)
    layers_t = target.config.num_hidden_layers
    layer_ids = [1, layers_t // 2, layers_t - 3]
    rows = int(pipe.manifest.draft_len) + 1
    max_seq = pipe.max_seq_len
    out = {}
    for layers in (1, 2):
        fields = decoder_fields(target, layers, intermediate=1536)
        gen = torch.Generator().manual_seed(layers)
        folder = _write(tmp / f"dflash{layers}", {**fields, "architectures": ["DFlashDraftModel"], "block_size": 8,
                                                  "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": 0}},
                        dense_tensors(gen, fields, len(layer_ids), target.config.hidden_size))
        spec = DFlashDrafterSpec(kind="dflash", name=f"dflash{layers}", path=folder)
        head = dflash.load(spec, target, tmp, "head").spec
        taps = tuple(sorted(head.taps))
        from specexport.exporter.heads.base import tap_columns

        graph = BlockGraph(head, tap_columns(taps, head.taps, target.config.hidden_size), max_seq).eval()
        inputs, outputs = graph_io(head)
        width = len(taps) * target.config.hidden_size
        proto = export_module(graph, example_inputs(graph, head, 1, rows, width), inputs, outputs, 18)
        name = f"dflash{layers}.block.b1.t{rows}"
        path = tmp / f"{name}.onnx"
        store = WeightStore(tmp / f"dflash{layers}.weights")
        store.save(proto, path)
        store.close()
        engine = OrtEngine(name, path, tensor_specs(proto, "inputs"), tensor_specs(proto, "outputs"),
                           EngineOptions(threads=args.threads))
        cache = KVCache(layers, 1, head.dense.kv_heads, max_seq, head.dense.head_dim)
        runner = BlockRunner(name, [engine], cache, {name: rows})
        runner.feeds(rows)[CONTEXT_FEATURES][:] = np.random.default_rng(0).normal(size=(1, rows, width))
        out[f"dflash {layers} layer{'s' if layers > 1 else ''}, block 8, C={rows}"] = (runner, [rows])
    return out


def _chain_runner(pipe, tmp: Path, args, name: str, kind: str, draft_vocab: int):
    """The one-token step graph of a random-weight chain head (EAGLE-3 or MTP) shaped for the
    directory's target, exported and opened as the runtime opens it."""
    import torch

    from specexport.exporter.heads.chain import (
        ChainGraph,
        ChainLayer,
        ChainSpec,
        Eagle3Stem,
        MtpStem,
        export_chain,
    )
    from specexport.exporter.onnx_export import WeightStore, tensor_specs
    from specexport.runtime.engine import EngineOptions
    from specexport.runtime.kv_cache import KVCache
    from specexport.runtime.ort_engine import OrtEngine
    from specexport.runtime.runner import ModelRunner

    info = pipe.manifest.models["target"]
    hidden, vocab, n_layers = int(info.info["hidden_size"]), int(info.vocab_size), info.num_layers
    heads, kv, hd = int(info.info["num_attention_heads"]), info.num_kv_heads, info.head_dim
    inter, max_seq = 1536, pipe.max_seq_len
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    width = 2 * hidden if kind == "eagle3" else hidden  # EAGLE-3's first layer reads [embedding, hidden]
    layer = ChainLayer(attn_norm=None if kind == "eagle3" else torch.ones(hidden), q_w=rand(heads * hd, width),
                       k_w=rand(kv * hd, width), v_w=rand(kv * hd, width), o_w=rand(hidden, heads * hd),
                       mlp_norm=torch.ones(hidden), gate_w=rand(inter, hidden), up_w=rand(inter, hidden),
                       down_w=rand(hidden, inter))
    if kind == "eagle3":
        stem = Eagle3Stem(fc=rand(hidden, 3 * hidden), input_norm=torch.ones(hidden), hidden_norm=torch.ones(hidden),
                          norm_before_residual=False)
        d2t = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values - torch.arange(draft_vocab)
        taps = (2, n_layers // 2, n_layers - 3)
    else:
        stem = MtpStem(proj=rand(hidden, 2 * hidden), embed_norm=torch.ones(hidden), hidden_norm=torch.ones(hidden),
                       hidden_first=False, mask_position0=False)
        d2t, taps = None, (n_layers,)
    freqs = torch.arange(max_seq).float()[:, None] / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
    spec = ChainSpec(kind=kind, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd, eps=1e-5, activation="silu",
                     attn_scale=hd**-0.5, embed=rand(vocab, hidden), stem=stem, layers=[layer],
                     out_norm=torch.ones(hidden), lm_head=rand(draft_vocab, hidden), hidden_out_normed=kind == "mtp",
                     rope=(angles.cos(), angles.sin()), target_vocab=vocab, taps=taps, target_hidden=hidden, d2t=d2t)
    proto = export_chain(ChainGraph(spec, taps, max_seq, step=True).eval(), 1, 1, hidden, 18)
    store = WeightStore(tmp / f"{name}.weights")
    path = tmp / f"{name}.step.b1.t1.onnx"
    store.save(proto, path)
    store.close()
    engine = OrtEngine(name, path, tensor_specs(proto, "inputs"), tensor_specs(proto, "outputs"),
                       EngineOptions(threads=args.threads))
    return ModelRunner(name, [engine], KVCache(1, 1, kv, max_seq, hd), {name: 1})


def eagle3_runners(pipe, tmp: Path, args) -> dict:
    """EAGLE-3 step graphs (one token, the head's own hidden in) with draft vocabularies of 8k and 32k."""
    return {f"eagle3 step, draft vocab {v // 1024}k": (_chain_runner(pipe, tmp, args, f"eagle3-{v}", "eagle3", v), [1])
            for v in (8192, 32768)}


def mtp_runners(pipe, tmp: Path, args) -> dict:
    """An MTP step graph over the target's whole vocabulary."""
    vocab = int(pipe.manifest.models["target"].vocab_size)
    return {"mtp step, full vocab": (_chain_runner(pipe, tmp, args, "mtp", "mtp", vocab), [1])}


# head kind -> function(pipe, tmp folder, args) -> {label: (runner, sizes)} to time
HEAD_KINDS = {"dflash": dflash_runners}
HEAD_KINDS.update({"eagle3": eagle3_runners, "mtp": mtp_runners})


def main() -> None:
    from specexport.runtime import load
    from specexport.runtime.runner import time_interleaved

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=str(REPO / "engines" / "smollm2-135m"))
    parser.add_argument("--kinds", nargs="*", default=list(HEAD_KINDS), choices=list(HEAD_KINDS))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    pipe = load(args.engines, threads=args.threads)
    runners = {"target decode step": (pipe.target, [1])}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            runners.update(HEAD_KINDS[kind](pipe, Path(tmp), args))
        times = time_interleaved(runners, args.rounds)
    step = times["target decode step"][1]
    print(f"{'graph':44s} {'ms':>8s} {'x target step':>14s}   ({args.rounds} interleaved rounds, medians)")
    for label, by_size in times.items():
        for seconds in by_size.values():
            print(f"{label:44s} {seconds * 1e3:8.2f} {seconds / step:14.2f}")


if __name__ == "__main__":
    main()
