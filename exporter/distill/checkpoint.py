"""The distill output folder, written whole at every checkpoint (``outdir.AtomicDir``: built in
``.NAME.partial-PID`` beside it, swapped in by one rename), so an interrupted run leaves the
last checkpoint and nothing half-written:

    DIR/config.json          SafeAILab EAGLE-3 config (draft_vocab_size, the taps it reads)
    DIR/model.safetensors    fc, midlayer.*, norm, lm_head (fp16), d2t int64, t2d bool
    DIR/distill.json         provenance: target, data, steps, wall time, the held-out curve
    DIR/state/               what --resume continues: fp32 weights, the optimizer's moments,
                             the training sequences' ids, counters and settings (state.json)

The head's loader (``exporter/heads/eagle3.py``) reads the top-level files only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specexport.errors import BadInput
from specexport.exporter.distill.data import Sequences
from specexport.exporter.outdir import AtomicDir

STATE = "state"
PROVENANCE = "distill.json"


@dataclass
class TrainState:
    weights: dict[str, torch.Tensor]  # checkpoint name -> fp32 tensor
    optimizer: dict  # torch optimizer state_dict
    sequences: Sequences
    draft_ids: np.ndarray  # [V_draft] target ids
    info: dict  # counters (step, epoch, train_seconds), settings, taps, fingerprint, curve


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors writes 0600


def _optimizer_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A torch optimizer state_dict as flat tensors + the JSON rest (its param groups)."""
    tensors = {f"{idx}.{key}": value for idx, slots in state["state"].items() for key, value in slots.items()
               if isinstance(value, torch.Tensor)}
    return tensors, {"param_groups": state["param_groups"]}


def _optimizer_state(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def write(dest: Path, config: dict, weights: dict[str, torch.Tensor], draft_ids: np.ndarray, vocab: int,
          provenance: dict, state: TrainState) -> None:
    """Write the whole folder, replacing ``dest`` only once every file is written."""
    with AtomicDir(dest) as tmp:
        head = {k: v.detach().float().cpu().half() for k, v in weights.items()}
        if not all(bool(torch.isfinite(v).all()) for v in head.values()):
            raise BadInput("distill: the head's weights are not finite in fp16 (training diverged); "
                           "lower --lr or resume from the last checkpoint")
        draft = torch.from_numpy(draft_ids)
        head["d2t"] = draft - torch.arange(len(draft))  # target id = i + d2t[i]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft] = True
        head["t2d"] = t2d
        _save(head, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
        folder = tmp / STATE
        folder.mkdir()
        _save({k: v.float() for k, v in state.weights.items()}, folder / "head.safetensors")
        opt_tensors, opt_rest = _optimizer_tensors(state.optimizer)
        _save(opt_tensors, folder / "optimizer.safetensors")
        _save({k: torch.from_numpy(v) for k, v in state.sequences.to_arrays().items()}
              | {"draft_ids": torch.from_numpy(state.draft_ids)}, folder / "sequences.safetensors")
        (folder / "state.json").write_text(json.dumps({**state.info, "optimizer": opt_rest}, indent=1) + "\n")


@dataclass
class InitHead:
    """A trained head a new run starts from (``--init``): its weights, draft vocabulary and taps."""

    config: dict
    weights: dict[str, torch.Tensor]  # checkpoint name -> fp32 tensor (d2t/t2d left out)
    draft_ids: np.ndarray  # [V_draft] target ids, ascending
    taps: list[int] | None  # the config's eagle_aux_hidden_state_layer_ids, if it names them


def read_head(folder: Path) -> InitHead:
    """An EAGLE-3 checkpoint in the SafeAILab layout (ours or a published one) to fine-tune."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise BadInput(f"--init: {path} not found; give a folder holding an EAGLE-3 checkpoint "
                           "(config.json, model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
        tensors = load_file(str(weights_path))
    except (OSError, ValueError, SafetensorError) as err:
        raise BadInput(f"--init: {folder}: unreadable checkpoint ({type(err).__name__}: {err})") from None
    if "d2t" not in tensors:
        raise BadInput(f"--init: {weights_path} has no d2t (draft-to-target ids); it is not an EAGLE-3 head "
                       "with a reduced draft vocabulary")
    d2t = tensors.pop("d2t").long()
    tensors.pop("t2d", None)
    draft_ids = (torch.arange(len(d2t)) + d2t).numpy().astype(np.int64)
    if np.any(np.diff(draft_ids) <= 0) or draft_ids[0] < 0:
        raise BadInput(f"--init: {weights_path}: d2t does not map to ascending target ids")
    taps = config.get("eagle_aux_hidden_state_layer_ids")
    return InitHead(config, {k: v.float() for k, v in tensors.items()}, draft_ids,
                    [int(t) for t in taps] if taps else None)


def has_state(dest: Path) -> bool:
    return (dest / STATE / "state.json").is_file()


def read(dest: Path) -> TrainState:
    """The training state of an earlier run's output folder (``--resume``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = dest / STATE
    if not has_state(dest):
        raise BadInput(f"--resume: {dest} holds no distill checkpoint ({folder / 'state.json'} not found)")
    try:
        info = json.loads((folder / "state.json").read_text())
        weights = load_file(str(folder / "head.safetensors"))
        opt = load_file(str(folder / "optimizer.safetensors"))
        arrays = {k: v.numpy() for k, v in load_file(str(folder / "sequences.safetensors")).items()}
        sequences = Sequences.from_arrays(arrays)
        draft_ids = arrays["draft_ids"].astype(np.int64)
        optimizer = _optimizer_state(opt, info.pop("optimizer"))
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise BadInput(f"--resume: {folder}: unreadable checkpoint ({type(err).__name__}: {err}); "
                       "start over with --force") from None
    return TrainState(weights, optimizer, sequences, draft_ids, info)
