"""Drafter heads that read the target's hidden states (EAGLE-3, MTP, DFlash, DSpark).

One module per kind, each with ``load(spec, target, base, origin) -> LoadedHead``: it reads a
published checkpoint (the layout detected from its files, a malformed one refused in one line
naming the tensor), says which target layers it reads (``taps``), and builds its own graphs
through a ``HeadContext`` (exporter/heads/base.py). ``HEAD_MODULES`` is the registry.
"""

from __future__ import annotations

import importlib

from specexport.exporter.heads.base import HeadContext, LoadedHead, merged_taps

# recipe drafter kind -> the module that loads and exports it
HEAD_MODULES = {
    "eagle3": "specexport.exporter.heads.eagle3",
    "mtp": "specexport.exporter.heads.mtp",
    "dflash": "specexport.exporter.heads.dflash",
    "dspark": "specexport.exporter.heads.dspark",
}


def load_head(spec, target, base, origin: str) -> LoadedHead:
    """Load the checkpoint of a hidden-state drafter spec (its kind's module, imported lazily)."""
    module = importlib.import_module(HEAD_MODULES[spec.kind])
    return module.load(spec, target, base, origin)


__all__ = ["HEAD_MODULES", "HeadContext", "LoadedHead", "load_head", "merged_taps"]
