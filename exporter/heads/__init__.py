"""Drafter heads that read the target's hidden states (EAGLE-3, MTP, DFlash, DSpark).

One module per kind, each with ``load(spec, target, base, origin) -> LoadedHead``: it reads a
published checkpoint (the layout detected from its files, a malformed one refused in one line
naming the tensor), says which target layers it reads (``taps``), and builds its own graphs
through a ``HeadContext`` (exporter/heads/base.py). ``HEAD_MODULES`` is the registry.
"""

from __future__ import annotations

import importlib

from specexport.contract import DrafterKind, drafter_kinds
from specexport.exporter.heads.base import HeadContext, LoadedHead, merged_taps

# drafter kind -> the module that loads and exports it: one per kind that reads the target's
# hidden states (contract.DRAFTER_KINDS), named after the kind
HEAD_MODULES: dict[DrafterKind, str] = {kind: f"specexport.exporter.heads.{kind.value}"
                                        for kind in drafter_kinds(reads_taps=True)}


def load_head(spec, target, base, origin: str) -> LoadedHead:
    """Load the checkpoint of a hidden-state drafter spec (its kind's module, imported lazily)."""
    module = importlib.import_module(HEAD_MODULES[spec.kind])
    return module.load(spec, target, base, origin)


__all__ = ["HEAD_MODULES", "HeadContext", "LoadedHead", "load_head", "merged_taps"]
