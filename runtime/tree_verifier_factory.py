"""The target's tree verifier over its slots: its tree verify graphs at every batch size built
up to them, over the target's cache, priced by the costs in use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specexport.contract import EngineEntry, Manifest
from specexport.runtime.engine import EngineOptions, LazyEngine, SharedGraphs
from specexport.runtime.model import Model
from specexport.runtime.tree_verify import TreeVerifier


def open_tree_verifier(manifest: Manifest, backend: str, target: Model, options: EngineOptions,
                       sessions: SharedGraphs, cost_ms: Callable[[EngineEntry], float | None]) -> TreeVerifier | None:
    """None: the directory has no tree graph on ``backend``."""
    entries = [e for e in manifest.engines_of("target", backend, batch=None, tree=True) if e.batch <= target.slots]
    if not entries:
        return None
    cache = target.runners[0].cache
    root: Path = manifest.root
    engines = {(e.batch, e.tokens): LazyEngine(e, root, options, cache, sessions) for e in entries}
    store = target.caches.store if target.caches.store is not None else cache.rows_store
    tuned = {(e.batch, e.tokens): ms / 1e3 for e in entries if (ms := cost_ms(e))}
    return TreeVerifier(engines, entries[-1], target.caches.slots, store, tuned)
