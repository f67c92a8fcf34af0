"""A preallocated, static KV cache owned by the runtime.

Allocated once per model at max_seq_len. Graphs read it whole (past_key_values.*) and return
only the K/V of the tokens they processed (present.*), which ``write`` copies into place.
Dropping rejected tokens is ``rewind``: the length moves back, nothing is copied or cleared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from specexport.contract import KVLayout, StateLayout
from specexport.runtime.cache_store import HostStore, Store
from specexport.runtime.state_store import HostStateStore


class CacheLength(ABC):
    """The bookkeeping every cache shares, wherever its tensors live: how many positions are
    filled. Rewinding moves the length back; nothing is copied or cleared."""

    def __init__(self, num_layers: int, max_seq_len: int):
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.length = 0

    @property
    def free(self) -> int:
        return self.max_seq_len - self.length

    def advance(self, count: int) -> None:
        """``count`` new positions were written at ``length`` (by an in-place graph, say)."""
        if count > self.free:
            raise ValueError(f"KV cache overflow: {count} tokens with {self.free} slots free")
        self.length += count

    @property
    def state_outputs(self) -> list[str]:
        """Outputs every graph run must return besides the K/V (a recurrent state's): none."""
        return []

    @abstractmethod
    def write(self, presents: dict[str, np.ndarray], count: int) -> None:
        """Append the first ``count`` positions of each present.* output at ``length``."""

    def store(self, outputs: dict[str, np.ndarray], count: int, in_place: bool) -> None:
        """Commit ``count`` new positions of one graph run: ``in_place``, the graph wrote its
        K/V into the cache; else its present.* outputs are copied in (``write``)."""
        if in_place:
            self.advance(count)
        else:
            self.write(outputs, count)

    def set_length(self, length: int) -> None:
        """The cache holds ``length`` positions from now on (only ever fewer than it was written)."""
        self.rewind(length)

    def rewind(self, length: int) -> None:
        """Forget every position at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of length {self.length} to {length}")
        self.length = length


class KVCache(CacheLength):
    """The cache in host memory, one [B, n_kv, S_max, hd] array per past input (a HostStore)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: str = "float32", store=None):
        """``store``: the rows' store when not host arrays (device_store.DeviceStore)."""
        super().__init__(num_layers, max_seq_len)
        shape = KVLayout(num_layers, num_kv_heads, head_dim, max_seq_len, dtype).shape(batch)  # [B, n_kv, S_max, hd]
        self.rows_store = store if store is not None else HostStore.allocate(num_layers, shape, dtype)

    def view(self) -> dict[str, np.ndarray]:
        """The feeds for a graph's past inputs: the cache arrays themselves, not copies."""
        return self.rows_store.rows()

    def write(self, presents: dict[str, np.ndarray], count: int) -> None:
        """Append the first ``count`` new positions of each present.* output at ``length``."""
        if count > self.free:
            raise ValueError(f"KV cache overflow: {count} tokens with {self.free} slots free")
        self.rows_store.write(presents, [(0, self.length, count)])
        self.advance(count)

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        """present.* -> the past buffer it updates, for graphs that write the cache in place."""
        return self.rows_store.bound()


class RecurrentRows:
    """What a cache with a recurrent state adds to its K/V (mixed into a KVCache): the state's
    feeds beside the K/V's, its present_state.* outputs asked of every run, and each committed
    run's states kept (``state_store``: this cache's row of a HostStateStore)."""

    state_store: HostStateStore
    length: int
    rows_store: Store

    @property
    def state_outputs(self) -> list[str]:
        """The present_state.* outputs every graph run must return."""
        return self.state_store.presents

    def view(self) -> dict[str, np.ndarray]:
        return {**self.rows_store.rows(), **self.state_store.rows()}

    def store(self, outputs: dict[str, np.ndarray], count: int, in_place: bool) -> None:
        """Commit ``count`` new positions: the K/V (copied in, or written in place by the graph)
        and the states after each of them."""
        start = self.length
        super().store(outputs, count, in_place)  # type: ignore[misc]
        self.state_store.write(outputs, [(0, start, count)])


class RecurrentCache(RecurrentRows, KVCache):
    """The cache of a model with linear-attention layers (Qwen3-Next, Qwen3.5): the KV cache of
    its attention layers, plus each linear layer's recurrent state (contract.StateLayout) in a
    state store (runtime/state_store.py), which has no positions to rewind. Every graph returns
    the state after each of its T positions (present_state.* [B, T, ...]); ``store`` keeps those
    of the positions it commits and the state at ``length`` is the past_state.* fed to the next
    graph. Rewinding selects a kept state, so it reaches back ``keep`` positions (a verify pass's
    rejected drafts, a drafter's own steps); further back only to 0 (the empty state)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 state: StateLayout, dtype: str = "float32", keep: int = 64, store=None):
        super().__init__(num_layers, batch, num_kv_heads, max_seq_len, head_dim, dtype, store)
        self.state_store = HostStateStore.allocate(state, batch, keep)  # past_state name -> [B, ...]

    def rewind(self, length: int) -> None:
        if length != self.length and not self.state_store.reaches(0, length):
            raise ValueError(f"cannot rewind a recurrent state of length {self.length} to {length}: only the "
                             f"last {self.state_store.keep} positions are kept")
        super().rewind(length)
        self.state_store.set_length(0, length)


def open_host_cache(num_layers: int, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                    dtype: str = "float32", state: StateLayout | None = None, keep: int = 64, store=None) -> KVCache:
    """The host cache of a model: a KVCache, or with linear-attention layers a RecurrentCache
    whose rewinds reach ``keep`` positions back (at least the tokens of the model's largest graph,
    so that any one graph run can be undone). ``store``: the K/V rows on a device (None: host
    arrays); a recurrent state stays in host memory either way."""
    if state is None:
        return KVCache(num_layers, batch, num_kv_heads, max_seq_len, head_dim, dtype, store)
    return RecurrentCache(num_layers, batch, num_kv_heads, max_seq_len, head_dim, state, dtype, keep, store)
