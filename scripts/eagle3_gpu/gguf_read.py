"""A minimal GGUF reader in numpy: metadata and the F32/F16/Q8_0/Q4_0/Q4_1 tensors of a Llama
file, dequantized to float32. Written from the GGUF spec (ggml docs/gguf.md) so the device job
needs nothing beyond numpy (the `gguf` package pulls yaml in through its metadata module).

Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata
(key, u32 type, value), the tensor infos (name, u32 n_dims, u64 dims fastest-first, u32 type,
u64 offset into the data section), then the data section at the next multiple of
general.alignment (32 by default).
"""

from __future__ import annotations

import struct

import numpy as np

# metadata value type -> struct format (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml tensor type -> (elements per block, bytes per block)
_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}
_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.data[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.take("<I"), self.take("<Q")
            if inner in _SCALARS and inner != 7:  # numeric arrays in one read (token scores, types)
                dtype = np.dtype(_SCALARS[inner])
                out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
                self.at += dtype.itemsize * count
                return out
            return [self.value(inner) for _ in range(count)]
        raise ValueError(f"GGUF: unknown metadata value type {kind}")


class GgufFile:
    """metadata: {key: value}; tensors: {name: (ggml type, numpy shape, absolute offset)}."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.raw = f.read()
        cur = _Cursor(memoryview(self.raw))
        if self.raw[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {self.raw[:4]!r})")
        cur.at = 4
        version = cur.take("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_meta = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict = {}
        for _ in range(n_meta):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, cur.take("<I"), tuple(reversed(dims)), cur.take("<Q")))  # numpy order
        align = int(self.metadata.get("general.alignment", 32))
        start = (cur.at + align - 1) // align * align
        self.tensors = {name: (kind, shape, start + offset) for name, kind, shape, offset in infos}

    def get(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, numpy shape (slowest dimension first)."""
        kind, shape, offset = self.tensors[name]
        if kind not in _BLOCKS:
            raise ValueError(f"GGUF tensor {name}: type {kind} is not supported ({', '.join(_NAMES.values())})")
        count = int(np.prod(shape))
        per_block, block_bytes = _BLOCKS[kind]
        nbytes = count // per_block * block_bytes
        buf = np.frombuffer(self.raw, dtype=np.uint8, count=nbytes, offset=offset)
        return _DEQUANT[kind](buf, count).reshape(shape)


def _f32(buf, count):
    return buf.view("<f4").astype(np.float32)


def _f16(buf, count):
    return buf.view("<f2").astype(np.float32)


def _q8_0(buf, count):
    blocks = buf.reshape(-1, 34)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n, 1]
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # [n, 32]
    return (scale * q).reshape(-1)


def _nibbles(qs):
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1).astype(np.float32)


def _q4_0(buf, count):
    blocks = buf.reshape(-1, 18)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
    return (scale * (_nibbles(blocks[:, 2:]) - 8.0)).reshape(-1)


def _q4_1(buf, count):
    blocks = buf.reshape(-1, 20)
    scale = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    low = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    return (scale * _nibbles(blocks[:, 4:]) + low).reshape(-1)


_DEQUANT = {0: _f32, 1: _f16, 2: _q4_0, 3: _q4_1, 8: _q8_0}
