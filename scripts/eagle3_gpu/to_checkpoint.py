"""Turn the device job's output (head_main.npz, head_lm.npz, config.json, eval.json,
train_log.txt) into an EAGLE-3 checkpoint in the SafeAILab layout that specexport's `eagle3`
loader reads: DEST/config.json + DEST/model.safetensors (fp16 weights, d2t int64, t2d bool;
no embed_tokens: the loader takes the target's), with the training record beside it
(DEST/training.json: data, settings, learning curve, held-out eval; DEST/train_log.txt).
Usage (HERE): .venv/bin/python scripts/eagle3_gpu/to_checkpoint.py SRC_DIR DEST_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

# name -> shape, from config.json (H hidden, I intermediate, q/kv widths, Vd draft vocabulary, V target vocabulary)
SHAPES = {
    "fc.weight": ("H", "3H"), "norm.weight": ("H",), "lm_head.weight": ("Vd", "H"),
    "midlayer.input_layernorm.weight": ("H",), "midlayer.hidden_norm.weight": ("H",),
    "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("Q", "2H"), "midlayer.self_attn.k_proj.weight": ("KV", "2H"),
    "midlayer.self_attn.v_proj.weight": ("KV", "2H"), "midlayer.self_attn.o_proj.weight": ("H", "Q"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"), "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"), "d2t": ("Vd",), "t2d": ("V",),
}


def main(src: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    h, hd = config["hidden_size"], config["head_dim"]
    dims = {"H": h, "3H": 3 * config["target_hidden_size"], "2H": 2 * h, "I": config["intermediate_size"],
            "Q": config["num_attention_heads"] * hd, "KV": config["num_key_value_heads"] * hd,
            "Vd": config["draft_vocab_size"], "V": config["vocab_size"]}
    arrays: dict[str, np.ndarray] = {}
    for name in ("head_main.npz", "head_lm.npz"):
        with np.load(src / name) as f:
            arrays.update({k: f[k] for k in f.files})
    if set(arrays) != set(SHAPES):
        sys.exit(f"to_checkpoint: tensors {sorted(set(arrays) ^ set(SHAPES))} missing or unexpected in {src}")
    tensors = {}
    for name, shape in SHAPES.items():
        a = arrays[name]
        want = tuple(dims[d] for d in shape)
        if a.shape != want:
            sys.exit(f"to_checkpoint: {name} has shape {a.shape}, expected {want}")
        if name == "d2t":
            tensors[name] = torch.from_numpy(a.astype(np.int64))
        elif name == "t2d":
            tensors[name] = torch.from_numpy(a.astype(bool))
        else:
            if not np.isfinite(a).all():
                sys.exit(f"to_checkpoint: {name} holds non-finite values")
            tensors[name] = torch.from_numpy(a.astype(np.float16))
    mapped = np.arange(dims["Vd"]) + arrays["d2t"]
    assert (np.flatnonzero(arrays["t2d"]) == mapped).all(), "d2t and t2d disagree"
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt", "producer": "specexport scripts/eagle3_gpu"})
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if (src / "eval.json").is_file():
        shutil.copyfile(src / "eval.json", dest / "training.json")
    if (src / "train_log.txt").is_file():
        shutil.copyfile(src / "train_log.txt", dest / "train_log.txt")
    (dest / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    size = (dest / "model.safetensors").stat().st_size
    print(f"wrote {dest}/model.safetensors ({size / 1e6:.1f} MB, {len(tensors)} tensors) and config.json "
          f"(draft vocabulary {dims['Vd']})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
