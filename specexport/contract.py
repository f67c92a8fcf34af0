"""The contract between the exporter and the runtime: names, roles, KV layout, manifest schema.

Both halves import this module and nothing else writes these facts down: tensor names of the
graphs, the role of each graph, how an engine is named, the KV cache layout, and the schema of
``manifest.json`` with its one writer (``manifest_to_json``/``write_manifest``) and its one
reader (``manifest_from_json``/``read_manifest``). Light on purpose: stdlib and numpy only, so
the runtime can import it without torch or onnx.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from specexport import atomic
from specexport.errors import BadInput

FORMAT = 1  # bump when a reader of the old format would misread the new one
MANIFEST = "manifest.json"
# sha256sum's line for manifest.json ("HEX  manifest.json"), written with it: a copied directory
# can be checked with `specexport verify` or `sha256sum -c manifest.sha256`. It detects
# corruption and accidental edits of the manifest, not someone who rewrites both files.
MANIFEST_SHA256 = "manifest.sha256"

# -- tensor names ---------------------------------------------------------------------------

INPUT_IDS = "input_ids"  # [B, T] int64
CACHE_LENGTH = "cache_length"  # [B] int64: filled cache positions before this call
# [B] int64, ort-gqa graphs: real tokens in each row's T (right-padded; 0 = an idle row, its
# cache untouched). Rows at different positions and with different counts share one call.
VALID_TOKENS = "valid_tokens"
PAST = "past_key_values"  # past_key_values.{i}.key|value [B, n_kv, S_max, head_dim]
PRESENT = "present"  # present.{i}.key|value: the T new positions, or the whole cache (in_place)
LOGITS = "logits"  # [B, T, V] float32
NEXT_TOKENS = "next_tokens"  # [B, T] int64, the in-graph argmax
KV_KINDS = ("key", "value")
# Tree verify graphs (Role.TREE, every batch size): the T rows are a token tree
# (runtime/tree.py), row 0 its root. Each row sits at cache_length + its offset (its depth) and
# attends to the cache and to its ancestors (ort-gqa graphs turn the mask into
# GroupQueryAttention's additive bias).
TREE_OFFSETS = "tree_offsets"  # [B, T] int64
TREE_MASK = "tree_mask"  # [B, T, T] bool: row t sees row t' (an ancestor, or itself)
# An ort-gqa target built with trees has ONE graph for chains and trees (one onnxruntime session,
# the weights prepacked once): its chain entries do not list the tree inputs, and the backend
# feeds them a chain's (chain_tree_feeds), constant for an entry's static shape.
CHAIN_TREE_INPUTS = (TREE_OFFSETS, TREE_MASK)
# A chain head's tree step (Role.TREE, every batch size): T draft nodes of one level per batch
# row, each fed the head's own hidden of its parent's row. The head's cache holds the committed
# rows and the rows of the nodes expanded before; row t sits at cache_length + TREE_OFFSETS[t]
# (its depth's position; the offset may be negative) and sees the cache slots this mask
# allows, and itself.
TREE_PAST_MASK = "tree_past_mask"  # [B, T, S_max] bool: row t sees cache slot s

# Drafters that read the target's hidden states (EAGLE-3, MTP, DFlash, DSpark).
# The target's graphs gain one output when a recipe has such a drafter: its tapped hidden states,
# concatenated in the order of ModelEntry.taps (indices in transformers' output_hidden_states
# convention: i < L is the residual stream entering layer i, L the final-normed output).
AUX_HIDDEN_STATES = "aux_hidden_states"  # [B, T, n_taps·hidden] float32
# Chain drafters (EAGLE-3, MTP): each row pairs a token with the features of the position before
# it: the target's taps (catch-up and prefill graphs) or the drafter's own hidden (step graph).
DRAFT_FEATURES = "draft_features"  # [B, T, F] float32 input
HIDDEN_OUT = "hidden_out"  # [B, T, H_draft] float32: the drafter's hidden, the next step's features
# Block drafters (DFlash, DSpark): one call adds the target's taps of newly committed positions to
# the drafter's context cache and drafts a whole block after the anchor token (input_ids [B, 1]).
CONTEXT_FEATURES = "context_features"  # [B, C, n_taps·hidden] float32, rows past context_valid are padding
CONTEXT_VALID = "context_valid"  # [B] int64: real rows of context_features
# DSpark: the block's final-normed hidden states of its drafting slots, read by the Markov and
# confidence heads that run after the block graph (runtime/block_drafter.py).
BLOCK_HIDDEN = "block_hidden"  # [B, n_drafts, H] float32


# Linear-attention layers (the Gated DeltaNet layers of Qwen3-Next and Qwen3.5) keep a recurrent
# state instead of a KV cache, indexed j = 0.. over those layers in model order (KV indices i run
# over the attention layers alone). A graph reads the state before its T tokens and returns the
# state after each of its T positions, so the runtime keeps the one at the last accepted token
# (a rejected draft is undone by selecting, not recomputing; vLLM's Mamba speculation does the same).
STATE_PAST = "past_state"  # past_state.{j}.conv [B, C, K-1], past_state.{j}.recurrent [B, Hv, dk, dv]
STATE_PRESENT = "present_state"  # present_state.{j}.conv [B, T, C, K-1], .recurrent [B, T, Hv, dk, dv]
STATE_KINDS = ("conv", "recurrent")


def state_past_names(num_layers: int) -> list[str]:
    return [f"{STATE_PAST}.{j}.{kind}" for j in range(num_layers) for kind in STATE_KINDS]


def state_present_names(num_layers: int) -> list[str]:
    return [f"{STATE_PRESENT}.{j}.{kind}" for j in range(num_layers) for kind in STATE_KINDS]


def state_present_of(past: str) -> str:
    """present_state.{j}.{kind} for past_state.{j}.{kind}."""
    return STATE_PRESENT + past[len(STATE_PAST):]


def past_name(layer: int, kind: str) -> str:
    return f"{PAST}.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"{PRESENT}.{layer}.{kind}"


def past_names(num_layers: int) -> list[str]:
    return [past_name(i, kind) for i in range(num_layers) for kind in KV_KINDS]


def present_names(num_layers: int) -> list[str]:
    return [present_name(i, kind) for i in range(num_layers) for kind in KV_KINDS]


def present_of(past: str) -> str:
    """present.{i}.{kind} for past_key_values.{i}.{kind}."""
    return PRESENT + past[len(PAST):]


def is_past(name: str) -> bool:
    """A KV cache input: past_key_values.{i}.{kind}."""
    return name.startswith(PAST + ".")


def is_present(name: str) -> bool:
    """A KV cache output: present.{i}.{kind} (not present_state.*)."""
    return name.startswith(PRESENT + ".")


def is_kv(name: str) -> bool:
    """A KV cache tensor, input or output."""
    return is_past(name) or is_present(name)


def is_state(name: str) -> bool:
    """A recurrent-state tensor, input (past_state.*) or output (present_state.*)."""
    return name.startswith((STATE_PAST + ".", STATE_PRESENT + "."))


def graph_inputs(num_layers: int, valid_tokens: bool = False, state_layers: int = 0,
                 tree: bool = False) -> list[str]:
    """``valid_tokens``: the graph takes VALID_TOKENS (ort-gqa graphs); ``num_layers``: the
    attention layers (KV cache); ``state_layers``: the linear-attention layers (recurrent state);
    ``tree``: a tree verify graph (TREE_OFFSETS, TREE_MASK)."""
    tree_inputs = [TREE_OFFSETS, TREE_MASK] if tree else []
    return [INPUT_IDS, CACHE_LENGTH, *tree_inputs, *([VALID_TOKENS] if valid_tokens else []),
            *past_names(num_layers), *state_past_names(state_layers)]


def chain_tree_feeds(names: set[str], ids: TensorSpec | None) -> dict[str, np.ndarray]:
    """A chain's tree inputs for a graph that also verifies trees: every row at its offset
    (offsets 0..T-1 [B, T]) seeing the rows before it (a causal mask [B, T, T]). ``names``: the
    inputs the graph has beyond an entry's; ``ids``: the entry's INPUT_IDS, [B, T]."""
    unknown = sorted(set(names) - set(CHAIN_TREE_INPUTS))
    if unknown or ids is None:
        raise BadInput(f"graph inputs {unknown or sorted(names)} are not in its manifest entry; rebuild the "
                       "engine directory")
    batch, tokens = ids.shape
    chain = {TREE_OFFSETS: np.broadcast_to(np.arange(tokens, dtype=np.int64), (batch, tokens)),  # [B, T]
             TREE_MASK: np.broadcast_to(np.tri(tokens, dtype=bool), (batch, tokens, tokens))}  # [B, T, T]
    return {name: np.ascontiguousarray(chain[name]) for name in names}


def graph_outputs(num_layers: int, state_layers: int = 0) -> list[str]:
    return [LOGITS, NEXT_TOKENS, *present_names(num_layers), *state_present_names(state_layers)]


# -- graph roles and engine names -----------------------------------------------------------


class Role(str, Enum):
    """What a graph is for. A str, so ``entry.role == "verify"`` holds."""

    DECODE = "decode"  # T = 1: the target alone, and each draft step
    CATCHUP = "catchup"  # T = 2: a drafter catching up after a fully accepted round
    VERIFY = "verify"  # T = 1 + D: one speculative round
    PREFILL = "prefill"  # T = prefill_chunk: the prompt, chunk by chunk
    PROBE = "probe"  # cost-curve sizes: opened only by bench and calibration
    STEP = "step"  # T = 1: a chain drafter (EAGLE-3, MTP) fed its own hidden state
    BLOCK = "block"  # a block drafter (DFlash, DSpark): C context rows in, one block of drafts out
    TREE = "tree"  # T = 1 + N: a token tree of N draft nodes under the root (TREE_* inputs)
    # A drafter's rows whose outputs nobody reads (its prompt, rows fed ahead of a catch-up): a
    # copy of its graph whose only outputs are what the cache keeps (presents, states), so no
    # logits are computed. Run only by ``ModelRunner.fill``, at batch 1.
    FILL = "fill"

    @property
    def decoding(self) -> bool:
        """May the decode loop (prefill included) run this graph for a call whose outputs it reads?"""
        return self not in (Role.PROBE, Role.FILL)


# One graph per (model, token count): when two roles want the same size, the first one here
# names it (a 2-token verify is also the catchup graph).
ROLE_PRIORITY = (Role.DECODE, Role.VERIFY, Role.CATCHUP, Role.PREFILL, Role.PROBE, Role.STEP, Role.BLOCK, Role.TREE,
                 Role.FILL)


# The roles built at every batch size of the recipe (shapes.batch); the others at batch 1 only.
BATCHED_ROLES = frozenset({Role.DECODE, Role.CATCHUP, Role.VERIFY})


def is_cache_output(name: str) -> bool:
    """An output the cache keeps (present.*, present_state.*): all a fill graph (Role.FILL) gives."""
    return is_present(name) or name.startswith(STATE_PRESENT + ".")


def engine_name(model: str, role: Role, batch: int, tokens: int) -> str:
    """target.verify.b1.t8"""
    return f"{model}.{Role(role).value}.b{batch}.t{tokens}"


# -- drafter kinds ----------------------------------------------------------------------------


class DrafterKind(str, Enum):
    """A drafter's kind: the recipe's ``kind`` and DrafterEntry.kind. A str, so
    ``entry.kind == "ngram"`` holds and manifests read and write the plain string."""

    NGRAM = "ngram"  # prompt lookup: no graphs
    SUFFIX = "suffix"  # SuffixDecoding: a suffix trie over the context and earlier responses, no graphs
    MODEL = "model"  # a smaller draft model with its own decoder graphs and cache
    QUANTIZED_SELF = "quantized-self"  # an int4 copy of the target: the same graphs
    EAGLE3 = "eagle3"  # chain head over the target's taps
    MTP = "mtp"  # chain head (multi-token prediction)
    DFLASH = "dflash"  # block head over the target's taps
    DSPARK = "dspark"  # block head + Markov and confidence heads (reads BLOCK_HIDDEN)

    def __str__(self) -> str:  # f"{kind}" is the value, as in the manifest
        return self.value


class DrafterFamily(str, Enum):
    """How a kind drafts, which decides its graphs and the runtime class that runs it."""

    LOOKUP = "lookup"  # no graphs, no model
    MODEL = "model"  # a decoder of its own: the target's graph signature
    CHAIN = "chain"  # one token per step, fed its own hidden state (STEP graph)
    BLOCK = "block"  # one call drafts a whole block from the target's features (BLOCK graph)


@dataclass(frozen=True)
class KindSignature:
    """One drafter kind's graphs. ``inputs``/``outputs`` name every graph tensor in graph order;
    PAST and PRESENT stand for the KV cache tensors (past_key_values.* / present.*, 2 per layer),
    and VALID_TOKENS is taken by ort-gqa graphs only (``graph_inputs(valid_tokens=True)``)."""

    kind: DrafterKind
    family: DrafterFamily
    # "module:factory" of its runtime drafter: (Pipeline, DrafterEntry, slots) -> Drafter,
    # imported when a pipeline first makes one (as Backend.engine)
    drafter: str
    roles: tuple[Role, ...]  # the roles of its graphs (none: it has no graphs)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    reads_taps: bool = False  # the target's graphs output AUX_HIDDEN_STATES for it
    # DrafterEntry.params a manifest must give (checked when the manifest is read)
    required_params: tuple[str, ...] = ()

    @property
    def runs_model(self) -> bool:
        """Does DrafterEntry.model name a ModelEntry with graphs of its own?"""
        return bool(self.roles)

    @property
    def block_hidden(self) -> bool:
        """Does its block graph output BLOCK_HIDDEN (DSpark's heads read it)?"""
        return BLOCK_HIDDEN in self.outputs

    def graph_inputs(self, num_layers: int, valid_tokens: bool = False) -> list[str]:
        names: list[str] = []
        for name in self.inputs:
            if name == PAST:
                names += past_names(num_layers)
            elif name != VALID_TOKENS or valid_tokens:
                names.append(name)
        return names

    def graph_outputs(self, num_layers: int, fill: bool = False) -> list[str]:
        """``fill``: a fill graph's (Role.FILL), the cache outputs alone."""
        names: list[str] = []
        for name in self.outputs:
            names += present_names(num_layers) if name == PRESENT else [] if fill else [name]
        return names


# a draft model's and a chain head's fill graphs (Role.FILL): built for ort-gqa recipes only
_MODEL_ROLES = (Role.DECODE, Role.CATCHUP, Role.PREFILL, Role.FILL)
_DECODER_INPUTS = (INPUT_IDS, CACHE_LENGTH, VALID_TOKENS, PAST)  # the target's own signature
_CHAIN_ROLES = (Role.STEP, Role.CATCHUP, Role.PREFILL, Role.FILL)
_CHAIN_INPUTS = (INPUT_IDS, DRAFT_FEATURES, CACHE_LENGTH, PAST)
_CHAIN_OUTPUTS = (LOGITS, NEXT_TOKENS, PRESENT, HIDDEN_OUT)
_BLOCK_INPUTS = (INPUT_IDS, CONTEXT_FEATURES, CONTEXT_VALID, CACHE_LENGTH, PAST)
# the runtime drafter of each family (KindSignature.drafter): EAGLE-3 and MTP draft a chain from
# the target's hidden states, DFlash and DSpark a block per call
_LOOKUP_DRAFTER = "specexport.runtime.drafter_factories:ngram"
_SUFFIX_DRAFTER = "specexport.runtime.suffix_drafter:make"
_MODEL_DRAFTER = "specexport.runtime.drafter_factories:model"
_SELF_DRAFTER = "specexport.runtime.drafter_factories:quantized_self"
_CHAIN_DRAFTER = "specexport.runtime.chain_drafter:make"
_BLOCK_DRAFTER = "specexport.runtime.block_drafter:make"

# The registry: every drafter kind the recipe accepts and a manifest may name, with its graphs
# and its runtime drafter. A new kind is an entry here, its recipe spec (exporter/recipe.py) and
# its runtime module (plus, for a head that reads the target's taps, exporter/heads/{kind}.py).
DRAFTER_KINDS: dict[DrafterKind, KindSignature] = {
    DrafterKind.NGRAM: KindSignature(DrafterKind.NGRAM, DrafterFamily.LOOKUP, _LOOKUP_DRAFTER, roles=()),
    DrafterKind.SUFFIX: KindSignature(DrafterKind.SUFFIX, DrafterFamily.LOOKUP, _SUFFIX_DRAFTER, roles=()),
    DrafterKind.MODEL: KindSignature(
        DrafterKind.MODEL, DrafterFamily.MODEL, _MODEL_DRAFTER, roles=_MODEL_ROLES,
        inputs=_DECODER_INPUTS, outputs=(LOGITS, NEXT_TOKENS, PRESENT)),
    DrafterKind.QUANTIZED_SELF: KindSignature(
        DrafterKind.QUANTIZED_SELF, DrafterFamily.MODEL, _SELF_DRAFTER, roles=_MODEL_ROLES,
        inputs=_DECODER_INPUTS, outputs=(LOGITS, NEXT_TOKENS, PRESENT)),
    DrafterKind.EAGLE3: KindSignature(
        DrafterKind.EAGLE3, DrafterFamily.CHAIN, _CHAIN_DRAFTER, roles=_CHAIN_ROLES,
        inputs=_CHAIN_INPUTS, outputs=_CHAIN_OUTPUTS, reads_taps=True),
    DrafterKind.MTP: KindSignature(
        DrafterKind.MTP, DrafterFamily.CHAIN, _CHAIN_DRAFTER, roles=_CHAIN_ROLES,
        inputs=_CHAIN_INPUTS, outputs=_CHAIN_OUTPUTS, reads_taps=True),
    DrafterKind.DFLASH: KindSignature(
        DrafterKind.DFLASH, DrafterFamily.BLOCK, _BLOCK_DRAFTER, roles=(Role.BLOCK,),
        inputs=_BLOCK_INPUTS, outputs=(LOGITS, NEXT_TOKENS, PRESENT), reads_taps=True, required_params=("drafts",)),
    DrafterKind.DSPARK: KindSignature(
        DrafterKind.DSPARK, DrafterFamily.BLOCK, _BLOCK_DRAFTER, roles=(Role.BLOCK,),
        inputs=_BLOCK_INPUTS, outputs=(LOGITS, NEXT_TOKENS, PRESENT, BLOCK_HIDDEN), reads_taps=True,
        required_params=("drafts",)),
}


def drafter_kinds(family: DrafterFamily | None = None, reads_taps: bool | None = None) -> tuple[DrafterKind, ...]:
    """The kinds of ``family`` (None: any) that read the target's taps or not (None: either)."""
    return tuple(k for k, sig in DRAFTER_KINDS.items()
                 if family in (None, sig.family) and reads_taps in (None, sig.reads_taps))


def drafter_kind(kind: str) -> DrafterKind:
    """``kind`` as a DrafterKind; ValueError naming the valid kinds."""
    try:
        return DrafterKind(kind)
    except ValueError:
        raise ValueError(f"unknown drafter kind {kind!r} (valid kinds: {', '.join(k.value for k in DrafterKind)})") \
            from None


# -- draft depth by batch size ----------------------------------------------------------------


@dataclass(frozen=True)
class DraftSchedule:
    """Draft depth by the number of running sequences, with TensorRT-LLM's draft_len_schedule
    semantics: ``steps`` are (upper bound on batch size, depth) pairs, ascending; a batch takes
    the depth of the first bound it does not exceed, and past the last bound speculation is off
    ({4: 4, 8: 2, 32: 1}: batch 1-4 drafts 4, 5-8 drafts 2, 9-32 drafts 1, above 32 none).
    vLLM's disable_by_batch_size N is the shorthand {N - 1: D}."""

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        bounds = [b for b, _ in self.steps]
        if not self.steps or bounds != sorted(set(bounds)) or bounds[0] < 1 or any(d < 0 for _, d in self.steps):
            raise BadInput(f"draft schedule {dict(self.steps)}: give ascending batch bounds >= 1 with depths >= 0")

    def depth(self, batch: int) -> int:
        return next((d for bound, d in self.steps if batch <= bound), 0)

    @classmethod
    def disable_by_batch_size(cls, batch: int, draft_len: int) -> DraftSchedule:
        return cls(((batch - 1, draft_len),))

    def to_json(self) -> list[list[int]]:
        return [[b, d] for b, d in self.steps]

    @classmethod
    def parse(cls, raw: list) -> DraftSchedule:
        return cls(tuple((int(b), int(d)) for b, d in raw))


# -- KV layout ------------------------------------------------------------------------------


class KVUpdate(str, Enum):
    APPEND = "append"  # present.* are the T new positions [B, n_kv, T, hd]; the runtime copies them in
    IN_PLACE = "in_place"  # present.* are the whole cache, bound to the past buffers


# recipe `attention` -> how its graphs update the cache
KV_UPDATE_OF_ATTENTION = {"standard": KVUpdate.APPEND, "ort-gqa": KVUpdate.IN_PLACE}


@dataclass(frozen=True)
class KVLayout:
    """One model's cache: 2 * num_layers tensors of kv_shape(batch)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str = "float32"

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.num_kv_heads, self.max_seq_len, self.head_dim)  # [B, n_kv, S_max, hd]


@dataclass(frozen=True)
class StateLayout:
    """One model's recurrent state (linear-attention layers): per layer a causal-convolution
    window and a [heads, key_dim, value_dim] state, both fixed-size whatever the length."""

    num_layers: int  # linear-attention layers
    conv_channels: int  # C: the convolved q, k and v channels
    conv_kernel: int  # K: the window holds the last K-1 inputs
    heads: int  # value heads of the recurrent state
    key_dim: int
    value_dim: int
    dtype: str = "float32"

    def conv_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.conv_channels, self.conv_kernel - 1)  # [B, C, K-1]

    def recurrent_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.heads, self.key_dim, self.value_dim)  # [B, Hv, dk, dv]

    def shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """past_state.* -> its shape."""
        return {name: self.conv_shape(batch) if name.endswith(".conv") else self.recurrent_shape(batch)
                for name in state_past_names(self.num_layers)}

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "conv_channels": self.conv_channels, "conv_kernel": self.conv_kernel,
                "heads": self.heads, "key_dim": self.key_dim, "value_dim": self.value_dim, "dtype": self.dtype}

    @classmethod
    def parse(cls, raw: dict) -> StateLayout:
        return cls(int(raw["num_layers"]), int(raw["conv_channels"]), int(raw["conv_kernel"]), int(raw["heads"]),
                   int(raw["key_dim"]), int(raw["value_dim"]), str(raw.get("dtype", "float32")))


# -- the manifest's entries -----------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, raw: list) -> TensorSpec:
        return cls(str(raw[0]), tuple(int(d) for d in raw[1]))

    def to_json(self) -> list:
        return [self.dtype, list(self.shape)]


@dataclass(frozen=True)
class EngineEntry:
    name: str  # engine_name(model, role, batch, tokens)
    model: str  # which model's weights and cache
    role: Role
    backend: str  # onnxruntime | tensorrt
    path: str
    batch: int
    tokens: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    parity: dict = field(default_factory=dict)  # figures against transformers (build-time validation)
    extra: dict = field(default_factory=dict)  # backend-specific facts (TensorRT version, GPU)
    cost_ms: float | None = None  # one run, measured at build time (adaptive depth reads it)
    kv_update: KVUpdate = KVUpdate.APPEND
    weights: str | None = None  # the model's shared weights file, for graphs that point into it
    sha256: str | None = None

    def compiled(self, backend: str, path: str, extra: dict) -> EngineEntry:
        """The same graph compiled for another backend: name, role, shapes and KV update kept;
        what belongs to this file (weights, parity, cost, hash) left to be measured again."""
        return replace(self, backend=backend, path=path, extra=dict(extra), weights=None, parity={},
                       cost_ms=None, sha256=None)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: str  # target | quantized-self | model | eagle3 | mtp | dflash | dspark
    kv: KVLayout
    vocab_size: int
    weights: str | None = None
    attention: str | None = None  # recipe attention: standard | ort-gqa
    info: dict = field(default_factory=dict)  # architecture summary and kind-specific facts (int4 bits...)
    # linear-attention layers' recurrent state (Qwen3-Next, Qwen3.5); None: every layer attends.
    # With it, ``kv`` covers the attention layers only.
    state: StateLayout | None = None

    # the cache facts by their old names
    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.kv.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.kv.head_dim

    @property
    def max_seq_len(self) -> int:
        return self.kv.max_seq_len

    @property
    def taps(self) -> tuple[int, ...]:
        """The target's tapped layers (AUX_HIDDEN_STATES), in transformers' hidden_states
        indices; empty when no drafter reads them."""
        return tuple(int(i) for i in self.info.get("taps", ()))

    @property
    def kv_dtype(self) -> str:
        return self.kv.dtype

    @property
    def full_rows(self) -> bool:
        """Every call must compute all its T rows as real tokens (``valid_tokens`` = T): a
        quantized model's rows agree bit for bit between calls only on that path (exporter/row_pad.py)."""
        return "quantization" in self.info

    @property
    def exactness(self) -> dict | None:
        """The build's probe of this model's quantized kernels (exporter/exact_rows.py): a
        quantized model's ``quantization.exactness``, an int8 head's ``weights_quantized.exactness``;
        None where none was recorded (not quantized, or built before the probe)."""
        quantized = self.info.get("quantization") or self.info.get("weights_quantized") or {}
        return quantized.get("exactness")

    @property
    def one_token_rows(self) -> int:
        """Rows a one-token call of this model computes: 2 where its whole graph pads a one-token
        call (exporter/row_pad.py; the probe's "all", and every quantized engine from before the
        probe), else 1. Where it is 2, a one-token step costs what depth 1 does."""
        quantization = self.info.get("quantization")
        if quantization is None:
            return 1
        return 2 if quantization.get("exactness", {}).get("pad", "all") == "all" else 1


@dataclass(frozen=True)
class DrafterParams:
    """DrafterEntry.params, typed. The defaults are what a reader assumes when a manifest
    leaves the field out (or writes null); each kind writes only its own fields."""

    # ngram
    max_ngram: int = 16
    min_ngram: int = 1
    # suffix (runtime/suffix_drafter.py says what each does)
    index_depth: int = 24
    max_match: int = 12
    spec_factor: float = 3.0
    min_token_prob: float = 0.1
    store_tokens: int = 16384
    store_prompts: bool = False
    chain_min_prob: float = 0.5
    # quantized-self (block_size also: block heads' block)
    bits: int | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    accuracy_level: int | None = None
    quantize_head: bool | None = None
    share_target_cache: bool | None = None  # None: on (runtime/drafter_factories.quantized_self)
    # hidden-state heads: the checkpoint's layout
    layout: str | None = None
    # block heads (DFlash, DSpark)
    drafts: int | None = None  # tokens one block call drafts
    from_anchor: bool | None = None  # the anchor's slot drafts too
    heads_file: str | None = None  # the numpy heads (.npz) beside the graphs
    markov: str | None = None  # DSpark's Markov head type (vanilla | gated | rnn), None: none
    confidence_with_markov: bool = False
    confidence_threshold: float = 0.0  # cut a draft below this running confidence (0: off)

    @classmethod
    def parse(cls, params: dict, owner: str = "drafter") -> DrafterParams:
        """Check the type of every known field; TypeError naming ``owner`` and the field.
        Unknown keys are left to ``DrafterEntry.params``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = params.get(f.name)
            if value is None:
                continue
            want = _PARAM_TYPES[f.name]
            ok = (isinstance(value, (int, float)) if want is float else isinstance(value, want)) \
                and (want is bool or not isinstance(value, bool))
            if not ok:
                raise TypeError(f"{owner}: params.{f.name} must be {_TYPE_WORDS[want]} (got {value!r})")
            values[f.name] = float(value) if want is float else value
        return cls(**values)


_PARAM_TYPES: dict[str, type] = {
    "max_ngram": int, "min_ngram": int, "index_depth": int, "max_match": int, "spec_factor": float,
    "min_token_prob": float, "store_tokens": int, "store_prompts": bool, "chain_min_prob": float, "bits": int, "block_size": int, "symmetric": bool, "accuracy_level": int,
    "quantize_head": bool, "share_target_cache": bool, "layout": str, "drafts": int, "from_anchor": bool, "heads_file": str, "markov": str,
    "confidence_with_markov": bool, "confidence_threshold": float,
}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    kind: DrafterKind  # a str given here is checked and converted (ValueError naming the valid kinds)
    model: str | None  # the ModelEntry it runs, if any
    params: dict = field(default_factory=dict)  # as written; read them typed through ``settings``
    settings: DrafterParams = field(init=False, repr=False, compare=False)  # params, typed

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", drafter_kind(self.kind))
        object.__setattr__(self, "settings", DrafterParams.parse(self.params, f"drafter {self.name!r}"))

    @property
    def signature(self) -> KindSignature:
        return DRAFTER_KINDS[self.kind]


@dataclass(frozen=True)
class Manifest:
    root: Path  # the engine directory (not written)
    name: str
    plan: dict  # the exporter's DraftPlanResult.to_dict(): draft_len, group_size, reason...
    tokenizer: dict  # file, chat_template, eos_token_ids, special_tokens, vocab_size, sha256
    models: dict[str, ModelEntry]
    drafters: dict[str, DrafterEntry]
    engines: list[EngineEntry]
    files: dict[str, str]  # relative path -> sha256
    format: int = FORMAT
    specexport: str | None = None  # version that wrote it
    created: str | None = None
    inputs_sha256: str | None = None  # what an unchanged rebuild compares
    recipe: dict | None = None
    recipe_dir: str | None = None  # where relative model paths in the recipe point
    toolchain: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # other top-level sections (tensorrt_build, ...), kept as they are

    @property
    def raw(self) -> dict:
        """The manifest as JSON data (what ``write_manifest`` writes)."""
        return manifest_to_json(self)

    @property
    def recipe_root(self) -> Path:
        """Where the recipe's relative model paths point (recipe_dir; "." when it was not written)."""
        return Path(self.recipe_dir or ".")

    @property
    def target_source(self) -> dict:
        """The recipe's ``target`` (its model source, as written); BadInput when the manifest
        carries no recipe."""
        if not self.recipe or not isinstance(self.recipe.get("target"), dict):
            raise BadInput(f"{self.root / MANIFEST}: the manifest has no recipe target; rebuild it with specexport build")
        return self.recipe["target"]

    @property
    def device(self) -> str | None:
        """The device the build ran on (toolchain's ``device``), None when not written."""
        return self.toolchain.get("device")

    @property
    def draft_len(self) -> int:
        return int(self.plan["draft_len"])

    @property
    def draft_schedule(self) -> DraftSchedule | None:
        """Depth by batch size (the plan's ``schedule``), None: the plan's D at every batch size."""
        raw = self.plan.get("schedule")
        return DraftSchedule.parse(raw) if raw else None

    def engines_of(self, model: str, backend: str, batch: int | None = 1, tree: bool = False) -> list[EngineEntry]:
        """The model's engines on ``backend`` at ``batch`` rows (None: every batch size), by
        tokens: its chain graphs, or with ``tree`` its tree verify graphs (Role.TREE) alone."""
        return sorted(
            (e for e in self.engines if e.model == model and e.backend == backend and batch in (None, e.batch)
             and (e.role is Role.TREE) == tree),
            key=lambda e: (e.batch, e.tokens),
        )

    def drafter_entry(self, name: str) -> DrafterEntry | None:
        """The drafter ``name`` runs as: the manifest's entry, else, for the name of a kind that
        needs nothing built (ngram, suffix), that kind with its defaults; None: neither."""
        if name in self.drafters:
            return self.drafters[name]
        built_free = {k.value: k for k, sig in DRAFTER_KINDS.items() if not sig.roles}
        return DrafterEntry(name, built_free[name], None) if name in built_free else None

    @property
    def runnable_drafters(self) -> list[str]:
        """Every name ``drafter_entry`` knows: the manifest's drafters, then the kinds without graphs."""
        return [*self.drafters, *(k.value for k, sig in DRAFTER_KINDS.items()
                                  if not sig.roles and k.value not in self.drafters)]

    def batch_sizes(self, model: str = "target") -> list[int]:
        """The batch sizes ``model`` has engines for (recipe shapes.batch)."""
        return sorted({e.batch for e in self.engines if e.model == model})

    def backends(self) -> list[str]:
        return sorted({e.backend for e in self.engines})

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        return read_manifest(root)

    def verify_files(self, only: list[str] | None = None) -> None:
        """Check the sha256 of every file (or of ``only``) against the manifest."""
        for rel, expected in self.files.items():
            if only is not None and rel not in only:
                continue
            if sha256_of(self.root / rel) != expected:
                raise BadInput(
                    f"{self.root / rel}: sha256 does not match the manifest (the file was changed "
                    "after the build); rebuild the engine directory with specexport build --force"
                )


# -- the one writer -------------------------------------------------------------------------


def _optional(**values: Any) -> dict:
    """The fields worth writing: None and empty sections are what the reader defaults to."""
    return {k: v for k, v in values.items() if v is not None and v != {}}


def engine_to_json(e: EngineEntry) -> dict:
    return {
        "name": e.name, "model": e.model, "role": Role(e.role).value, "backend": e.backend, "path": e.path,
        **_optional(weights=e.weights),
        "batch": e.batch, "tokens": e.tokens,
        "inputs": {k: v.to_json() for k, v in e.inputs.items()},
        "outputs": {k: v.to_json() for k, v in e.outputs.items()},
        "kv_update": KVUpdate(e.kv_update).value,
        **_optional(cost_ms=e.cost_ms, parity=dict(e.parity), extra=dict(e.extra), sha256=e.sha256),
    }


def model_to_json(m: ModelEntry) -> dict:
    kv = {"num_layers": m.kv.num_layers, "num_kv_heads": m.kv.num_kv_heads, "head_dim": m.kv.head_dim,
          "max_seq_len": m.kv.max_seq_len, "dtype": m.kv.dtype}
    return {"kind": m.kind, **m.info, "vocab_size": m.vocab_size, "kv": kv,
            **_optional(state=None if m.state is None else m.state.to_json(), weights=m.weights,
                        attention=m.attention)}


def drafter_to_json(d: DrafterEntry) -> dict:
    return {"name": d.name, "kind": DrafterKind(d.kind).value, "model": d.model, "params": dict(d.params)}


def manifest_to_json(m: Manifest) -> dict:
    return {
        "format": m.format,
        **_optional(specexport=m.specexport),
        "name": m.name,
        **_optional(created=m.created, inputs_sha256=m.inputs_sha256, recipe=m.recipe, recipe_dir=m.recipe_dir),
        "plan": dict(m.plan),
        "tokenizer": dict(m.tokenizer),
        "models": {name: model_to_json(entry) for name, entry in m.models.items()},
        "drafters": [drafter_to_json(d) for d in m.drafters.values()],
        "engines": [engine_to_json(e) for e in m.engines],
        "files": dict(m.files),
        **_optional(toolchain=dict(m.toolchain), build=dict(m.build)),
        **m.extra,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):  # recipe paths
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to the manifest")


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1, default=_json_default)


def write_manifest(directory: Path, manifest: Manifest) -> dict:
    """Write ``directory/manifest.json``; return what was written, as JSON data."""
    data = json.loads(dumps(manifest_to_json(manifest)))  # what a reader will see (paths as str)
    text = dumps(data)
    atomic.write_text(Path(directory) / MANIFEST, text)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    atomic.write_text(Path(directory) / MANIFEST_SHA256, f"{digest}  {MANIFEST}\n")
    return data


# -- the one reader -------------------------------------------------------------------------

_MANIFEST_KEYS = {"format", "specexport", "name", "created", "inputs_sha256", "recipe", "recipe_dir", "plan",
                  "tokenizer", "models", "drafters", "engines", "files", "toolchain", "build"}


def engine_from_json(e: dict) -> EngineEntry:
    try:
        role = Role(e["role"])
    except ValueError:
        raise ValueError(f"engine {e['name']!r} has role {e['role']!r} (known: {', '.join(r.value for r in Role)})") from None
    return EngineEntry(
        name=e["name"], model=e["model"], role=role, backend=e["backend"], path=e["path"],
        batch=int(e["batch"]), tokens=int(e["tokens"]),
        inputs={k: TensorSpec.parse(v) for k, v in e["inputs"].items()},
        outputs={k: TensorSpec.parse(v) for k, v in e["outputs"].items()},
        parity=dict(e.get("parity", {})), extra=dict(e.get("extra", {})), cost_ms=e.get("cost_ms"),
        kv_update=KVUpdate(e.get("kv_update", KVUpdate.APPEND.value)),
        weights=e.get("weights"), sha256=e.get("sha256"),
    )


def model_from_json(name: str, m: dict) -> ModelEntry:
    kv = m["kv"]
    layout = KVLayout(int(kv["num_layers"]), int(kv["num_kv_heads"]), int(kv["head_dim"]), int(kv["max_seq_len"]),
                      str(kv["dtype"]))
    info = {k: v for k, v in m.items() if k not in ("kind", "vocab_size", "kv", "state", "weights", "attention")}
    state = StateLayout.parse(m["state"]) if m.get("state") else None
    return ModelEntry(name, m["kind"], layout, int(m["vocab_size"]), m.get("weights"), m.get("attention"), info,
                      state)


def drafter_from_json(d: dict) -> DrafterEntry:
    """TypeError/ValueError naming the drafter on an unknown kind, a wrong-typed or missing param."""
    name = d["name"]
    try:
        kind = drafter_kind(d["kind"])
    except ValueError as err:
        raise ValueError(f"drafter {name!r}: {err}") from None
    params = d.get("params") or {}
    if not isinstance(params, dict):
        raise TypeError(f"drafter {name!r}: params must be a mapping (got {params!r})")
    missing = [p for p in DRAFTER_KINDS[kind].required_params if params.get(p) is None]
    if missing:
        raise ValueError(f"drafter {name!r} ({kind.value}): params.{missing[0]} is missing")
    return DrafterEntry(name, kind, d.get("model"), dict(params))


def manifest_from_json(raw: dict, root: Path) -> Manifest:
    """Raises KeyError/TypeError/ValueError on a malformed manifest (read_manifest words them)."""
    return Manifest(
        root=root,
        name=raw["name"],
        plan=dict(raw["plan"]),
        tokenizer=dict(raw["tokenizer"]),
        models={name: model_from_json(name, m) for name, m in raw["models"].items()},
        drafters={d["name"]: drafter_from_json(d) for d in raw.get("drafters", [])},
        engines=[engine_from_json(e) for e in raw["engines"]],
        files=dict(raw["files"]),
        format=int(raw["format"]),
        specexport=raw.get("specexport"),
        created=raw.get("created"),
        inputs_sha256=raw.get("inputs_sha256"),
        recipe=raw.get("recipe"),
        recipe_dir=raw.get("recipe_dir"),
        toolchain=dict(raw.get("toolchain") or {}),
        build=dict(raw.get("build") or {}),
        extra={k: v for k, v in raw.items() if k not in _MANIFEST_KEYS},
    )


def read_manifest(root: str | Path) -> Manifest:
    """Check the format and that every file named exists; one-line BadInput otherwise."""
    root = Path(root)
    if not root.exists():
        raise BadInput(f"{root}: engine directory not found (build one with: specexport build RECIPE -o {root})")
    path = root / MANIFEST
    if not root.is_dir() or not path.is_file():
        raise BadInput(f"{root}: not an engine directory (no {MANIFEST}); build one with specexport build")
    try:
        raw = json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(f"{path}: not valid JSON ({err}); rebuild the engine directory") from None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt != FORMAT:
        raise BadInput(
            f"{path}: manifest format {fmt!r} is not supported (this runtime reads format {FORMAT}); "
            "rebuild with this version of specexport"
        )
    try:
        manifest = manifest_from_json(raw, root)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise BadInput(f"{path}: malformed manifest ({type(err).__name__}: {err}); rebuild it") from None
    for rel in manifest.files:
        if not (root / rel).is_file():
            raise BadInput(f"{root / rel}: file named in the manifest is missing; rebuild the engine directory")
    return manifest


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
