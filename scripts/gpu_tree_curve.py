"""The tile rule on a GPU: cost of a verify pass as a function of its rows (1 + D for a chain,
1 + N for a token tree), for the default model's shape and a larger one, with torch on CUDA.

Random weights of the real shapes (timing does not depend on their values), bf16, batch 1, a
static KV cache holding ``past`` positions; every pass is captured in a CUDA graph and replayed,
so launch overhead stays out and what is left is the kernels. A pass runs the whole decoder:
QKV, rotary, attention over the cache and the new rows under a tree's ancestor mask, O, MLP,
norms and the LM head. The attention alone is also timed (the part the 128-row tile rule is
about: G query heads x rows share one K/V head), with the tree mask and without any mask (which
lets torch pick its fused flash kernel). Prints one JSON document; no arguments
needed besides --out. On a CPU it runs a tiny smoke version (--smoke).

    python scripts/gpu_tree_curve.py --out curve.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # name: layers, hidden, heads, kv heads, head dim, intermediate, vocab
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152),  # G = 3: tile rule D = 41
    "llama3-8b-4layers": (4, 4096, 32, 8, 128, 14336, 128256),  # G = 4: D = 31; 4 of 32 layers
}


def tree_mask(rows: int, past: int, device) -> torch.Tensor:
    """[1, 1, rows, past + rows] bool: every row sees the cache; a random tree (each node under
    an earlier one) over the new rows, the root first."""
    gen = torch.Generator().manual_seed(rows)
    new = torch.zeros(rows, rows, dtype=torch.bool)
    new[:, 0] = True
    for i in range(1, rows):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        new[i] = new[parent]
        new[i, i] = True
    full = torch.cat((torch.ones(rows, past, dtype=torch.bool), new), dim=1)
    return full.view(1, 1, rows, past + rows).to(device)


class Decoder(torch.nn.Module):
    def __init__(self, layers, hidden, heads, kv, hd, inter, vocab, past, max_rows, device, dtype):
        super().__init__()
        self.heads, self.kv, self.hd, self.past = heads, kv, hd, past
        mk = lambda *s: torch.randn(*s, device=device, dtype=dtype) * 0.02  # noqa: E731
        self.embed = mk(vocab, hidden)
        self.layers = [dict(qkv=mk(hidden, (heads + 2 * kv) * hd), o=mk(heads * hd, hidden),
                            gu=mk(hidden, 2 * inter), down=mk(inter, hidden),
                            n1=torch.ones(hidden, device=device, dtype=dtype),
                            n2=torch.ones(hidden, device=device, dtype=dtype),
                            k=mk(1, kv, past + max_rows, hd), v=mk(1, kv, past + max_rows, hd))
                       for _ in range(layers)]
        self.norm = torch.ones(hidden, device=device, dtype=dtype)
        self.lm_head = mk(hidden, vocab)
        pos = torch.arange(past + max_rows, device=device, dtype=torch.float32)
        freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.outer(pos, freq)
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def rope(self, x, positions):  # x [1, h, T, hd]
        c, s = self.cos[positions], self.sin[positions]  # [T, hd/2]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)

    def forward(self, ids, positions, mask):  # ids [1, T], positions [T], mask [1, 1, T, past+T]
        rows = ids.shape[1]
        x = self.embed[ids]  # [1, T, H]
        for w in self.layers:
            h = F.rms_norm(x, (x.shape[-1],), w["n1"])
            q, k, v = (h @ w["qkv"]).split((self.heads * self.hd, self.kv * self.hd, self.kv * self.hd), -1)
            q = self.rope(q.view(1, rows, self.heads, self.hd).transpose(1, 2), positions)
            k = self.rope(k.view(1, rows, self.kv, self.hd).transpose(1, 2), positions)
            w["k"][:, :, self.past : self.past + rows] = k  # the new rows, written in place
            w["v"][:, :, self.past : self.past + rows] = v.view(1, rows, self.kv, self.hd).transpose(1, 2)
            keys, values = w["k"][:, :, : self.past + rows], w["v"][:, :, : self.past + rows]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(1, rows, -1) @ w["o"]
            h = F.rms_norm(x, (x.shape[-1],), w["n2"])
            g, u = (h @ w["gu"]).chunk(2, -1)
            x = x + (F.silu(g) * u) @ w["down"]
        return (F.rms_norm(x, (x.shape[-1],), self.norm) @ self.lm_head).argmax(-1)  # [1, T]


def timed(replays: int, cuda: bool, fn, *args, **kwargs) -> float:
    """Median ms of one call fn(*args, **kwargs): captured in a CUDA graph and replayed (CPU:
    plain calls)."""
    fn = functools.partial(fn, *args, **kwargs)
    if not cuda:
        fn()
        start = time.perf_counter()
        for _ in range(replays):
            fn()
        return (time.perf_counter() - start) / replays * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end) / replays)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device (a CPU check)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows_list = [1, 2, 4, 6, 8, 12, 16, 24, 32, 40, 42, 44, 48, 56, 64, 80, 96, 128, 160, 192, 256]
    pasts = [512, 4096]
    shapes = dict(SHAPES)
    replays = 50
    if args.smoke:
        shapes = {"smoke": (2, 64, 6, 2, 16, 128, 512)}
        rows_list, pasts, replays = [1, 4, 8], [32], 2
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "batch": 1, "curves": []}
    for name, shape in shapes.items():
        layers, hidden, heads, kv, hd, inter, vocab = shape
        for past in pasts:
            model = Decoder(*shape, past=past, max_rows=max(rows_list), device=device, dtype=dtype)
            full, attention, flash = {}, {}, {}
            for rows in rows_list:
                ids = torch.randint(0, vocab, (1, rows), device=device)
                positions = torch.arange(past, past + rows, device=device)
                mask = tree_mask(rows, past, device)
                with torch.no_grad():
                    full[rows] = timed(replays, cuda, model, ids, positions, mask)
                    q = torch.randn(1, heads, rows, hd, device=device, dtype=dtype)
                    keys = model.layers[0]["k"][:, :, : past + rows]
                    values = model.layers[0]["v"][:, :, : past + rows]
                    attention[rows] = timed(replays * 4, cuda, F.scaled_dot_product_attention,
                                            q, keys, values, attn_mask=mask, enable_gqa=True)
                    # no mask: the fused flash kernel (every row sees every key), GQA in-kernel
                    flash[rows] = timed(replays * 4, cuda, F.scaled_dot_product_attention, q, keys, values,
                                        enable_gqa=True)
            base, base_att = full[1], attention[1]
            report["curves"].append({
                "model": name, "group": heads // kv, "tile_rows": 128 // (heads // kv), "past": past,
                "rows": rows_list,
                "pass_ms": [round(full[r], 4) for r in rows_list],
                "pass_relative": [round(full[r] / base, 3) for r in rows_list],
                "attention_layer_ms": [round(attention[r], 4) for r in rows_list],
                "attention_relative": [round(attention[r] / base_att, 3) for r in rows_list],
                "attention_unmasked_ms": [round(flash[r], 4) for r in rows_list],
                "attention_unmasked_relative": [round(flash[r] / flash[1], 3) for r in rows_list]})
            print(json.dumps(report["curves"][-1]), flush=True)
            model = None  # the next shape's weights and cache in its place
            if cuda:
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
