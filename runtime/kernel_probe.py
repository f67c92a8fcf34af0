"""Does this CPU's onnxruntime compute a row alone the way it computes the same row in a bigger call?

A quantized target is exact under speculation only if its one-token decode and its multi-token
verify give a row the same logits bit for bit. Whether they do depends on the kernels the
machine's MLAS picks: on AVX2 / AVX-VNNI, MatMulNBits has a one-row kernel of its own (4-bit
blocks of 32 and more); on AVX512-VNNI 4-bit blocks of 16 and 32 and 8-bit blocks agree at any
row count while blocks of 64 and 128 differ even between multi-row calls; GroupQueryAttention's
one-token path multiplies probabilities by V through sgemm's one-row branch. So the exporter and
the runtime ask the machine: each kernel a graph uses (recorded in the manifest as a ``Kernel``
spec) runs as a one-op model on random data, and its rows are compared between a call of one
row, calls of two, three and the largest row count the engine runs, at the session's thread count.

The verdict is what a graph must pad (``PADS``): "none", "attention" (each GroupQueryAttention
runs a one-token call as two query rows), or "all" (the whole graph runs a one-token call as two
tokens: exporter/row_pad.py), or a refusal where rows of multi-row calls disagree (no pad makes
those exact). numpy + onnxruntime only: the graphs are written by runtime/onnx_bytes.py.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from specexport.runtime.onnx_bytes import Node, Value, model_bytes

PADS = ("none", "attention", "all")  # least to most padded: a graph padded more than needed stays exact
MATMUL, ATTENTION = "matmul", "attention"  # what part of a graph a kernel is
SEED = 52
ONE_ROW_CHECKS = 3  # rows compared alone against the same rows inside bigger calls


def _session(model: bytes, threads: int | None):
    """A session as the runtime makes one: on the process's shared thread pool, optimized alike."""
    import onnxruntime as ort

    from specexport.runtime.ort_engine import session_options

    return ort.InferenceSession(model, session_options(ort, threads), providers=["CPUExecutionProvider"])


def _matmul_agreement(kernel: QuantMatMul | FloatMatMul, threads: int | None, max_rows: int) -> Agreement:
    """A matmul's rows [rows, K] alone against the same rows inside bigger calls."""
    rng = np.random.default_rng(SEED)
    session = _session(kernel.model(rng), threads)
    x = rng.standard_normal((max(max_rows, 2), kernel.k)).astype(np.float32)  # [rows, K]
    return _row_agreement(lambda rows: session.run(None, {"x": rows})[0], x)


@dataclass(frozen=True)
class QuantMatMul:
    """One MatMulNBits as a graph uses it: weight [K, N] in blocks of ``block_size``."""

    k: int
    n: int
    bits: int
    block_size: int
    accuracy_level: int
    zero_points: bool = True
    op = "MatMulNBits"
    part = MATMUL

    def model(self, rng: np.random.Generator) -> bytes:
        blocks = -(-self.k // self.block_size)
        blob = self.block_size * self.bits // 8
        weights = {"w": rng.integers(0, 256, (self.n, blocks, blob), dtype=np.uint8),  # [N, blocks, blob]
                   "scales": (rng.random((self.n, blocks), dtype=np.float32) * 0.02 + 0.001)}  # [N, blocks]
        inputs = ["x", "w", "scales"]
        if self.zero_points:
            weights["zp"] = rng.integers(0, 256, (self.n, -(-blocks * self.bits // 8)), dtype=np.uint8)
            inputs.append("zp")
        attrs = (("K", self.k), ("N", self.n), ("bits", self.bits), ("block_size", self.block_size),
                 ("accuracy_level", self.accuracy_level))
        node = Node("MatMulNBits", tuple(inputs), ("y",), "com.microsoft", attrs)
        return model_bytes("probe", [node], [Value("x", "float32", ("rows", self.k))],
                           [Value("y", "float32", ("rows", self.n))], weights)

    def agreement(self, threads: int | None, max_rows: int, max_tokens: int) -> Agreement:
        return _matmul_agreement(self, threads, max_rows)


@dataclass(frozen=True)
class FloatMatMul:
    """A MatMul of an fp32 weight [K, N] (a Q4_1 graph's block sums and offsets): sgemm has a
    one-row branch of its own."""

    k: int
    n: int
    op = "MatMul"
    part = MATMUL

    def model(self, rng: np.random.Generator) -> bytes:
        weight = rng.standard_normal((self.k, self.n)).astype(np.float32)  # [K, N]
        return model_bytes("probe", [Node("MatMul", ("x", "w"), ("y",))], [Value("x", "float32", ("rows", self.k))],
                           [Value("y", "float32", ("rows", self.n))], {"w": weight})

    def agreement(self, threads: int | None, max_rows: int, max_tokens: int) -> Agreement:
        return _matmul_agreement(self, threads, max_rows)


@dataclass(frozen=True)
class Attention:
    """One GroupQueryAttention as an ort-gqa graph uses it: packed QKV in, the cache [1, kv, S, hd]
    updated in place, rotary inside the op where ``do_rotary``."""

    num_heads: int
    kv_num_heads: int
    head_dim: int
    max_seq_len: int
    scale: float
    do_rotary: int = 1
    softcap: float = 0.0
    local_window_size: int = 0  # 0: none (the op's -1)
    query_seqlens: bool = True  # the graph feeds the op's query_seqlens input
    op = "GroupQueryAttention"
    part = ATTENTION

    @property
    def width(self) -> int:
        return (self.num_heads + 2 * self.kv_num_heads) * self.head_dim

    def model(self, rng: np.random.Generator) -> bytes:
        attrs: list[tuple[str, int | float]] = [("num_heads", self.num_heads), ("kv_num_heads", self.kv_num_heads),
                                                ("scale", float(self.scale)), ("do_rotary", self.do_rotary)]
        if self.softcap:
            attrs.append(("softcap", float(self.softcap)))
        if self.local_window_size:
            attrs.append(("local_window_size", self.local_window_size))
        angles = rng.random((self.max_seq_len, self.head_dim // 2), dtype=np.float32) * 6.28  # [S, hd/2]
        tables = {"cos": np.cos(angles), "sin": np.sin(angles)} if self.do_rotary else {}
        inputs = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", *tables]
        if self.query_seqlens:
            inputs += [""] * (16 - len(inputs)) + ["query_seqlens"]
        cache = ("batch", self.kv_num_heads, self.max_seq_len, self.head_dim)
        values = [Value("qkv", "float32", ("batch", "tokens", self.width)), Value("past_key", "float32", cache),
                  Value("past_value", "float32", cache), Value("seqlens_k", "int32", ("batch",)),
                  Value("total", "int32", ())]
        if self.query_seqlens:
            values.append(Value("query_seqlens", "int32", ("batch",)))
        node = Node("GroupQueryAttention", tuple(inputs), ("out", "present_key", "present_value"), "com.microsoft",
                    tuple(attrs))
        outputs = [Value("out", "float32", ("batch", "tokens", self.num_heads * self.head_dim)),
                   Value("present_key", "float32", cache), Value("present_value", "float32", cache)]
        return model_bytes("probe", [node], values, outputs, tables)

    def agreement(self, threads: int | None, max_rows: int, max_tokens: int) -> Agreement:
        """Rows of a call of ``max_tokens`` tokens after a filled past, against calls of fewer
        tokens at the same position and one-token calls at each position over the cache the big
        call wrote (as a decode step after it would see it). The cache is passed, not bound in
        place as the runtime binds it: the op then copies it first, and its outputs were equal
        bit for bit to the in-place path's (SmolLM2's shape, onnxruntime 1.32, 2026-12-06)."""
        rng = np.random.default_rng(SEED)
        session = _session(self.model(rng), threads)
        tokens = min(max(max_tokens, 2), self.max_seq_len // 2)
        past = min(40, self.max_seq_len - tokens)  # filled positions before the call
        qkv = rng.standard_normal((1, tokens, self.width)).astype(np.float32)  # [1, T, width]
        cache = np.zeros((1, self.kv_num_heads, self.max_seq_len, self.head_dim), dtype=np.float32)  # [1, kv, S, hd]
        cache[:, :, :past] = rng.standard_normal((1, self.kv_num_heads, past, self.head_dim))

        def run(start: int, count: int, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, ...]:
            """Tokens start..start+count-1 of qkv at positions past+start.. -> (out [count, H·hd],
            the caches after the call [1, kv, S, hd] ×2)."""
            feeds = {"qkv": np.ascontiguousarray(qkv[:, start:start + count]), "past_key": key, "past_value": value,
                     "seqlens_k": np.array([past + start + count - 1], dtype=np.int32),
                     "total": np.array(past + start + count, dtype=np.int32)}
            if self.query_seqlens:
                feeds["query_seqlens"] = np.array([count], dtype=np.int32)
            out, present_key, present_value = session.run(None, feeds)
            return out[0], present_key, present_value

        whole, key, value = run(0, tokens, cache, cache * 0.5)  # [T, H·hd]; key, value: the cache it wrote
        rows_equal = all(np.array_equal(run(0, count, cache, cache * 0.5)[0], whole[:count])
                         for count in _counts(tokens))
        alone = np.stack([run(j, 1, key, value)[0][0] for j in range(min(ONE_ROW_CHECKS, tokens))])  # [j, H·hd]
        return Agreement(bool(np.array_equal(alone, whole[:len(alone)])), rows_equal,
                         float(np.abs(alone - whole[:len(alone)]).max()))


Kernel = QuantMatMul | FloatMatMul | Attention
KINDS: dict[str, type[QuantMatMul] | type[FloatMatMul] | type[Attention]] = {
    cls.op: cls for cls in (QuantMatMul, FloatMatMul, Attention)}


def kernel_record(kernel: Kernel) -> dict:
    """The manifest's form of a kernel spec: its op and fields."""
    return {"op": kernel.op, **asdict(kernel)}


def kernel_of(record: dict) -> Kernel:
    """A kernel spec from its manifest record (kernel_record's); a KeyError names an unknown op."""
    cls = KINDS[record["op"]]
    return cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})


@dataclass(frozen=True)
class Agreement:
    one_row_equal: bool  # a row alone equals the same row in a bigger call
    rows_equal: bool  # rows of multi-row calls equal each other at every row count probed
    max_abs_diff: float  # between a row alone and the same row in a bigger call


def _counts(largest: int) -> list[int]:
    """Multi-row call sizes compared with the largest: 2, 3, 8 and the largest itself."""
    return sorted({c for c in (2, 3, 8, largest) if c <= largest})


def _row_agreement(run: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> Agreement:
    """x [rows, K]: each row's output in calls of two rows is the reference; calls of every
    count in _counts must give it, and so must a row alone (ONE_ROW_CHECKS rows)."""
    rows = len(x)
    pairs = np.concatenate([run(x[start:start + 2]) for start in range(0, rows - 1, 2)])  # [rows (even), N]
    if len(pairs) < rows:  # an odd count: its last row from the last two
        pairs = np.concatenate([pairs, run(x[rows - 2:])[1:]])
    rows_equal = all(np.array_equal(run(x[:count]), pairs[:count]) for count in _counts(rows))
    alone = np.concatenate([run(x[i:i + 1]) for i in range(min(ONE_ROW_CHECKS, rows))])  # [j, N]
    return Agreement(bool(np.array_equal(alone, pairs[:len(alone)])), rows_equal,
                     float(np.abs(alone - pairs[:len(alone)]).max()))


@dataclass(frozen=True)
class Probe:
    """What the machine said about each kernel of a graph, at one thread count and row range."""

    kernels: tuple[tuple[Kernel, Agreement], ...]
    threads: int | None
    max_rows: int  # the most rows (batch × tokens) one call of the engine computes
    max_tokens: int  # the most tokens per sequence of one call

    @property
    def pad(self) -> str:
        """What a graph must pad so a one-token call computes what verify computes (PADS)."""
        one_row = {kernel.part for kernel, agreed in self.kernels if not agreed.one_row_equal}
        return "all" if MATMUL in one_row else "attention" if ATTENTION in one_row else "none"

    @property
    def refusal(self) -> str | None:
        """Why no pad makes this graph exact on this machine: rows of multi-row calls disagree."""
        bad = [kernel for kernel, agreed in self.kernels if not agreed.rows_equal]
        if not bad:
            return None
        what = "; ".join(describe(kernel) for kernel in bad)
        return (f"on this CPU the rows of multi-row calls of {what} differ between row counts (up to "
                f"{self.max_rows} rows, {self.threads or 'default'} threads), so no pad makes decode and "
                f"verify agree: use quantization.block_size 32 or 16, or precision: int8")

    def record(self) -> dict:
        """The manifest's record of this probe."""
        return {"pad": self.pad, "threads": self.threads, "max_rows": self.max_rows, "max_tokens": self.max_tokens,
                "kernels": [{**kernel_record(kernel), **asdict(agreed)} for kernel, agreed in self.kernels]}


def describe(kernel: Kernel) -> str:
    if isinstance(kernel, QuantMatMul):
        return (f"MatMulNBits {kernel.k}x{kernel.n} {kernel.bits}-bit blocks of {kernel.block_size} at accuracy "
                f"level {kernel.accuracy_level}")
    if isinstance(kernel, FloatMatMul):
        return f"MatMul {kernel.k}x{kernel.n}"
    return f"GroupQueryAttention {kernel.num_heads}/{kernel.kv_num_heads} heads of {kernel.head_dim}"


@functools.lru_cache(maxsize=32)
def _probe_cached(kernels: tuple[Kernel, ...], threads: int | None, max_rows: int, max_tokens: int) -> Probe:
    return Probe(tuple((k, k.agreement(threads, max_rows, max_tokens)) for k in kernels), threads, max_rows,
                 max_tokens)


def probe(kernels: Sequence[Kernel], threads: int | None, max_rows: int, max_tokens: int) -> Probe:
    """Each distinct kernel run on this machine, on the threads the process's sessions run on
    (its shared pool: made at ``threads`` where it is new; memoized per process: the answer is
    the CPU's)."""
    import onnxruntime as ort

    from specexport.runtime.ort_engine import SHARED_POOL, physical_cores

    pool = SHARED_POOL.threads_for(ort, threads or physical_cores())
    return _probe_cached(tuple(dict.fromkeys(kernels)), pool, max_rows, max_tokens)


Prober = Callable[..., Probe]  # probe's signature: (kernels, threads, max_rows, max_tokens)


CPU_FLAGS = ("avx512_vnni", "avx512f", "avx_vnni", "avx2")  # what decides MLAS's kernels, the widest first


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this machine has (Linux: /proc/cpuinfo; elsewhere its architecture's
    name), for the manifest's record and the bench baseline's key."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return [platform.machine()]
    flags = next((line.split(":", 1)[1].split() for line in info.read_text().splitlines()
                  if line.startswith("flags")), [])
    return [f for f in CPU_FLAGS if f in flags]


def check_engine(record: dict | None, threads: int | None, label: str, prober: Prober | None = None) -> str | None:
    """At load: re-probe the kernels a quantized model's manifest recorded, at this session's
    thread count. Returns a one-line refusal where this CPU needs more padding than the engine
    was built with or cannot be exact at all; None where the engine is exact here. ``record``:
    the manifest's ``quantization.exactness`` (None: an engine from before the probe, padded in
    full, which is exact wherever multi-row calls agree: nothing to check)."""
    if not record or not record.get("kernels"):
        return None
    kernels = [kernel_of(k) for k in record["kernels"]]
    here = (prober or probe)(kernels, threads, int(record["max_rows"]), int(record["max_tokens"]))
    if here.refusal is not None:
        return f"{label}: {here.refusal}"
    built = record["pad"]
    if PADS.index(here.pad) > PADS.index(built):
        differs = [describe(k) for k, a in here.kernels if not a.one_row_equal]
        return (f"{label}: built with pad '{built}' on a CPU whose kernels agreed, but here a row alone differs "
                f"from verify's ({'; '.join(differs)}), so decode would not be exact: rebuild the engine on this "
                f"CPU (specexport build RECIPE; the probe then pads '{here.pad}')")
    return None


def exactness_summary(quantization: dict | None, unprobed_pad: str = "all") -> dict | None:
    """What a quantized model's manifest says its one-token calls pad, and which probed kernels
    agree alone and which differ (bench's report); None for a model that is not quantized.
    ``unprobed_pad``: what an engine from before the probe pads (a target's graphs: all; a head's:
    none)."""
    if quantization is None:
        return None
    record = quantization.get("exactness")
    if not record:
        return {"pad": unprobed_pad, "agrees_alone": [], "differs_alone": [], "cpu_flags": [], "probed": False}
    kernels = [(describe(kernel_of(k)), k.get("one_row_equal", True)) for k in record["kernels"]]
    return {"pad": record["pad"], "probed": True, "held": record.get("held", True),
            "cpu_flags": record.get("cpu_flags", []),
            "agrees_alone": [name for name, equal in kernels if equal],
            "differs_alone": [name for name, equal in kernels if not equal]}


def model_exactness_summary(info: dict) -> dict | None:
    """exactness_summary of one manifest model's info: a quantized model's ``quantization`` (padded
    in full before the probe), an int8 head's ``weights_quantized`` (never padded), or the
    quantized-self drafter's observed record (never padded, not held to agree)."""
    if "quantization" in info:
        return exactness_summary(info["quantization"])
    if "exactness" in info:
        return exactness_summary(info)
    return exactness_summary(info.get("weights_quantized"), unprobed_pad="none")
