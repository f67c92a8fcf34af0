"""A preallocated, static KV cache owned by the runtime.

Allocated once per model at max_seq_len. Graphs read it whole (past_key_values.*) and return
only the K/V of the tokens they processed (present.*), which ``write`` copies into place.
Dropping rejected tokens is ``rewind``: the length moves back, nothing is copied or cleared.
"""

from __future__ import annotations

import numpy as np

from specexport.contract import KVLayout, past_names, present_of


class CacheLength:
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

    def rewind(self, length: int) -> None:
        """Forget every position at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of length {self.length} to {length}")
        self.length = length


class KVCache(CacheLength):
    """The cache in host memory, one [B, n_kv, S_max, hd] array per past input."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: str = "float32"):
        super().__init__(num_layers, max_seq_len)
        shape = KVLayout(num_layers, num_kv_heads, head_dim, max_seq_len, dtype).shape(batch)  # [B, n_kv, S_max, hd]
        self._tensors = {name: np.zeros(shape, dtype=dtype) for name in past_names(num_layers)}
        self._present_names = {name: present_of(name) for name in self._tensors}

    def view(self) -> dict[str, np.ndarray]:
        """The feeds for a graph's past inputs: the cache arrays themselves, not copies."""
        return self._tensors

    def write(self, presents: dict[str, np.ndarray], count: int) -> None:
        """Append the first ``count`` new positions of each present.* output at ``length``."""
        if count > self.free:
            raise ValueError(f"KV cache overflow: {count} tokens with {self.free} slots free")
        at = self.length
        for past_name, present_name in self._present_names.items():
            new = presents[present_name]  # [B, n_kv, T, hd]
            self._tensors[past_name][:, :, at : at + count] = new[:, :, :count]
        self.advance(count)

    def in_place_outputs(self) -> dict[str, np.ndarray]:
        """present.* -> the past buffer it updates, for graphs that write the cache in place."""
        return {present: self._tensors[past] for past, present in self._present_names.items()}

