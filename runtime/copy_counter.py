"""What the runtime copies between host memory and the engines' memory, in bytes.

A graph's inputs and outputs cross between the host (numpy) and where its session runs. On a
GPU each crossing is a copy over the bus; on the CPU the same traffic is memory the engine
reads or writes in host arrays. The counter counts it either way, per direction, the cache's
tensors (K/V, recurrent state) apart from the rest, so that a test on the CPU can tell what a
GPU would copy: with the device store a decode step moves no cache bytes, with host arrays it
moves the whole cache in and out.
"""

from __future__ import annotations

from dataclasses import dataclass

from specexport.contract import is_kv, is_state


def is_cache(name: str) -> bool:
    """A cache tensor (past/present K/V or recurrent state)."""
    return is_kv(name) or is_state(name)


@dataclass
class CopyCounter:
    to_device_cache: int = 0
    to_device_other: int = 0
    to_host_cache: int = 0
    to_host_other: int = 0

    def to_device(self, name: str, nbytes: int) -> None:
        if is_cache(name):
            self.to_device_cache += nbytes
        else:
            self.to_device_other += nbytes

    def to_host(self, name: str, nbytes: int) -> None:
        if is_cache(name):
            self.to_host_cache += nbytes
        else:
            self.to_host_other += nbytes

    def add(self, other: CopyCounter) -> None:
        self.to_device_cache += other.to_device_cache
        self.to_device_other += other.to_device_other
        self.to_host_cache += other.to_host_cache
        self.to_host_other += other.to_host_other

    @property
    def cache_bytes(self) -> int:
        """Cache bytes copied either way."""
        return self.to_device_cache + self.to_host_cache

    def snapshot(self) -> CopyCounter:
        return CopyCounter(self.to_device_cache, self.to_device_other, self.to_host_cache, self.to_host_other)

    def since(self, before: CopyCounter) -> CopyCounter:
        """What was copied since ``before`` (a snapshot)."""
        return CopyCounter(self.to_device_cache - before.to_device_cache,
                           self.to_device_other - before.to_device_other,
                           self.to_host_cache - before.to_host_cache, self.to_host_other - before.to_host_other)

    def to_dict(self) -> dict[str, int]:
        return {"to_device_cache": self.to_device_cache, "to_device_other": self.to_device_other,
                "to_host_cache": self.to_host_cache, "to_host_other": self.to_host_other}
