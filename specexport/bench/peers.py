"""Peers for `specexport bench`: other inference stacks run on the same model (fp32 unless said).

``make_peers`` makes them in the calling process; the bench runs each through
``bench/peer_process.start_peers``, in a process of its own (that module says why).

The harness interleaves their runs with ours so a reader sees where our engines stand. Each
peer generates greedily from the prompt ids it is given and reports its wall times:

- ``transformers-greedy``: ``model.generate(do_sample=False)``, sdpa attention.
- ``transformers-prompt-lookup``: the same with ``prompt_lookup_num_tokens=10`` (transformers'
  own prompt lookup; it matches n-grams of up to ``max_matching_ngram_size`` = 2 tokens).
- ``transformers-assistant``: the same with ``assistant_model``: the recipe's draft model (its
  first ``kind: model`` drafter; a recipe without one skips it), transformers' assisted decoding.

The transformers peers run where ``PeerDevice`` says: ``bench --device cuda`` puts them on the
same GPU in fp16 (``GPU_PEER_DEVICE``), what a GPU user would otherwise run; the other peers are
CPU stacks and run only with the default, cpu and fp32.
- ``ort-genai``: onnxruntime-genai (optional: ``make bench-peers``) on an fp32 CPU model made by
  its own model builder from the target, run with greedy search.
- ``ort-genai-ngram``: the same model with onnxruntime-genai's n-gram speculative decoding
  (``ngram_size=3``: the last 2 tokens are looked up; ``max_draft_tokens=4``).
- ``ort-genai-int4``: onnxruntime-genai's int4 CPU model of the same target, made by its model
  builder with its int4 defaults for the cpu execution provider, passed explicitly
  (``ORT_GENAI_INT4``: RTN, block 32, ``accuracy_level`` 4 = activations quantized to int8 per
  block, symmetric) and recorded in the peer's settings and each run's stats; greedy search.
  Its output is not expected to equal our fp32 target's.
- ``ort-genai-int4-ngram``: the same int4 model with the n-gram options of ``ort-genai-ngram``.
- ``llama-cpp``: llama-cpp-python (optional: ``make bench-peers``) on the very GGUF file the
  recipe's target was built from (a target that is not a GGUF skips it), greedy (temperature 0,
  top_k 1), fed the prompt ids as they are (the GGUF's own tokenizer has the same vocabulary). It
  runs ``Llama.generate``, the token loop ``create_completion(stream=True)`` iterates, timing each
  token, and stops on a token the GGUF's vocabulary calls end-of-generation (EOS kept, as the
  other peers keep it). ``n_threads`` and ``n_threads_batch`` are the bench's threads; ``n_ctx``
  is at least 512 and grows (the model reloaded, untimed) when a prompt plus its new tokens
  would not fit. The GGUF's own weights: quantized (SmolLM2's is Q4_1), so its output is not
  expected to equal ours either. llama.cpp's OpenMP threads are easily starved: in a process
  that had imported torch its decode ran about 100 times slower, and with other busy processes
  on the same 2 cores some runs fell to about 1 tok/s (both seen with 0.3.36). The bench runs it
  in a process of its own; run it on an otherwise idle machine.
- ``llama-cpp-lookup``: the same with llama-cpp-python's prompt lookup,
  ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)`` (``max_ngram_size`` its default
  2). llama-cpp-python's README suggests 10 for GPU and 2 on CPU-only machines; we pin 10, as
  the measurement in ../shared/references.md ("Quantized targets") did, so numbers compare. A
  draft model makes llama-cpp-python keep the logits of every evaluated position
  (``logits_all``): that cost is part of what it measures.

Threads: ``make_peers`` calls ``torch.set_num_threads(threads)`` when a transformers peer is
asked for. That setting is global to the process (the bench runs each peer in a process of its own); the
onnxruntime-genai peers set ``intra_op_num_threads`` on their own session, the llama.cpp peers
``n_threads`` and ``n_threads_batch`` on theirs.

Batched (``bench --batch``): the target-alone peers that can batch, ``transformers-greedy``
and ``ort-genai`` (``BATCHED_PEERS``), also run ``run_batch(prompts, max_new_tokens)``: one
left-padded batch of the prompts, greedy, decoded together until every row is done (static
batching: a finished row idles until the longest one ends); each row's tokens are cut after its
first EOS, as a single run's are.

The onnxruntime-genai models are built once, into ``cache_dir/ort-genai-fp32`` and
``cache_dir/ort-genai-int4`` (the target is saved as a transformers directory in
``cache_dir/hf`` for the builder, which is removed once the build succeeds), and reused while the
target's files, the onnxruntime-genai version and the build options are unchanged (a stamp file
in each records them). The llama.cpp peers build nothing: they read the GGUF where the recipe
names it, resolved here without the exporter (``gguf_file``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specexport import atomic
from specexport.errors import BadInput

PEER_NAMES = ("transformers-greedy", "transformers-prompt-lookup", "transformers-assistant", "ort-genai",
              "ort-genai-ngram", "ort-genai-int4", "ort-genai-int4-ngram", "llama-cpp", "llama-cpp-lookup")
# what a GPU user runs on the same model: bench --device cuda's peers unless --peers names others
GPU_PEERS = ("transformers-greedy", "transformers-prompt-lookup", "transformers-assistant")
# each speculative peer's own plain decoding: greedy speculation is lossless when its tokens equal these
PLAIN_PEER = {"transformers-prompt-lookup": "transformers-greedy", "transformers-assistant": "transformers-greedy",
              "ort-genai-ngram": "ort-genai",
              "ort-genai-int4-ngram": "ort-genai-int4", "llama-cpp-lookup": "llama-cpp"}
# transformers prompt lookup: 10 candidate tokens, matching n-grams of up to 2 tokens (its default, pinned).
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}
# onnxruntime-genai's n-gram speculative options (docs/SpeculativeDecoding.md in its repository):
# ngram_size N matches the last N-1 committed tokens; max_draft_tokens is the fixed proposal width.
ORT_GENAI_NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}
ORT_GENAI_DIR = "ort-genai-fp32"
ORT_GENAI_INT4_DIR = "ort-genai-int4"
ORT_GENAI_STAMP = "specexport-peer.json"
# The model builder's int4 defaults for the cpu execution provider (its --extra_options help in
# 0.18.0), passed explicitly so that the build is what the stamp and the report say, whatever a
# later builder's defaults: algo_config "default" = MatMulNBitsQuantizer's RTN; weights in blocks
# of 32; accuracy_level 4 = MatMulNBits quantizes the activations to int8 per block (its fast CPU
# path); symmetric int4 (no zero points).
ORT_GENAI_INT4 = {"algo_config": "default", "block_size": 32, "accuracy_level": 4, "is_symmetric": True}
# llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding): 10 proposed tokens, n-grams of up to 2 (its default)
LLAMA_CPP_LOOKUP = {"num_pred_tokens": 10, "max_ngram_size": 2}
LLAMA_CPP_MIN_CTX = 512  # the llama.cpp peers' smallest context; it grows to fit longer requests
INSTALL_HINT = "make bench-peers"
# the peers that decode a batch of prompts together (run_batch): the target alone only
BATCHED_PEERS = ("transformers-greedy", "ort-genai")


@dataclass(frozen=True)
class PeerDevice:
    """Where the transformers peers run: torch's device and the dtype their weights are cast to
    (the target loads in fp32 first: _check_fp32)."""

    device: str = "cpu"
    dtype: str = "float32"

    @property
    def is_default(self) -> bool:
        return (self.device, self.dtype) == ("cpu", "float32")


GPU_PEER_DEVICE = PeerDevice("cuda", "float16")


@dataclass
class PeerRun:
    token_ids: list[int]  # generated ids only (not the prompt), EOS included if produced
    total_s: float  # wall time of the whole generation call
    first_token_s: float  # wall time to the first token: in this run where its loop shows it, else a 1-token run's
    stats: dict = field(default_factory=dict)  # what the peer says about itself (ort-genai-ngram: acceptance)
    # from the first token to the last, timed in this run, where the peer's loop lets it be
    # (onnxruntime-genai; transformers through a streamer); else decode time is
    # total_s - first_token_s, two runs apart
    decode_s: float | None = None
    # the tokens decode_s produced: all but the first step's (a prompt-lookup step emits several);
    # None: all but the first token
    decode_tokens: int | None = None


class _TokenTimes:
    """A transformers streamer (``put``/``end``, as transformers.generation.BaseStreamer) that
    times each step's new tokens: (seconds, count). generate puts the prompt first."""

    def __init__(self, sync=None) -> None:
        self.prompt_seen = False
        self.steps: list[tuple[float, int]] = []
        self.sync = sync  # on a GPU, waits for the step's kernels so that the mark is when it ended

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.sync is not None:
            self.sync()
        self.steps.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


@dataclass
class BatchPeerRun:
    token_ids: list[list[int]]  # per prompt, generated ids only, cut after the first EOS (included)
    total_s: float  # wall time of the whole batched generation call


def _cut(tokens: list[int], eos_ids, max_new_tokens: int) -> list[int]:
    """A row of a batched generation up to and with its first EOS (later positions are padding)."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


class Peer(Protocol):
    name: str
    threads: int  # threads it was told to use
    settings: dict  # how it was configured, for the report

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PeerRun: ...


def _check_request(prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise BadInput("a peer needs a non-empty prompt")
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be at least 1 (got {max_new_tokens})")


# --- transformers -------------------------------------------------------------------------


class TransformersPeer:
    def __init__(self, name: str, model, eos_ids: list[int], pad_id: int, threads: int, assistant=None,
                 **generate_kwargs):
        self.name = name
        self.threads = threads
        self.model = model
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.generate_kwargs = generate_kwargs
        self.assistant = assistant  # transformers-assistant: the draft model, on the target's device
        self.device = model.device
        self.settings = {
            "attn_implementation": model.config._attn_implementation,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            **generate_kwargs,
            **({"assistant_model": assistant.config.name_or_path or type(assistant).__name__,
                "assistant_layers": assistant.config.num_hidden_layers} if assistant is not None else {}),
        }

    def _sync(self):
        """torch.cuda.synchronize on a GPU (the streamer's marks wait for the step), else None."""
        import torch

        return torch.cuda.synchronize if self.device.type == "cuda" else None

    def _generate(self, input_ids, mask, max_new_tokens: int, streamer=None):
        import torch

        with torch.inference_mode():
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
                streamer=streamer,
                **({"assistant_model": self.assistant} if self.assistant is not None else {}),
                **self.generate_kwargs,
            )

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        import torch

        from specexport.exporter.sources import quiet_transformers

        _check_request(prompt_ids, max_new_tokens)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        mask = torch.ones_like(input_ids)
        times = _TokenTimes(self._sync())  # decode timed within the run: a separate 1-token run's
        # time, subtracted, can exceed a short run's whole time on busy cores
        with quiet_transformers():
            start = time.perf_counter()
            out = self._generate(input_ids, mask, max_new_tokens, times)
            if (sync := self._sync()) is not None:
                sync()
            total_s = time.perf_counter() - start
        steps = times.steps
        first_token_s = steps[0][0] - start if steps else total_s
        decode_s = steps[-1][0] - steps[0][0] if len(steps) > 1 else None
        decode_tokens = sum(count for _, count in steps[1:]) if len(steps) > 1 else None
        return PeerRun(out[0, len(prompt_ids):].tolist(), total_s, first_token_s, decode_s=decode_s,
                       decode_tokens=decode_tokens)

    def run_batch(self, prompts: list[list[int]], max_new_tokens: int) -> BatchPeerRun:
        """The prompts left-padded into one batch, one greedy ``generate`` call."""
        import torch

        from specexport.exporter.sources import quiet_transformers

        for prompt_ids in prompts:
            _check_request(prompt_ids, max_new_tokens)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(input_ids)
        for row, prompt_ids in enumerate(prompts):
            input_ids[row, width - len(prompt_ids):] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
            mask[row, width - len(prompt_ids):] = 1
        with quiet_transformers():
            start = time.perf_counter()
            out = self._generate(input_ids, mask, max_new_tokens)
            if (sync := self._sync()) is not None:
                sync()
            total_s = time.perf_counter() - start
        eos = set(self.eos_ids)
        return BatchPeerRun([_cut(row[width:].tolist(), eos, max_new_tokens) for row in out], total_s)


# --- onnxruntime-genai --------------------------------------------------------------------


class OrtGenaiPeer:
    def __init__(self, name: str, og, model, eos_ids: list[int], threads: int, speculative: dict | None = None,
                 pad_id: int | None = None, precision: str = "fp32"):
        self.name = name
        self.pad_id = int(pad_id if pad_id is not None else min(eos_ids))
        self.threads = threads
        self.og = og
        self.model = model
        self.eos_ids = set(eos_ids)
        self.speculative = dict(speculative or {})
        # the model builder's quantization options, where the model is quantized
        self.build = {"int4": dict(ORT_GENAI_INT4)} if precision == "int4" else {}
        self.settings = {"onnxruntime_genai": og.__version__, "precision": precision, "search": "greedy",
                         "intra_op_num_threads": threads, **self.speculative, **self.build}

    def _generator(self, prompt_ids: list[int], max_length: int):
        import numpy as np

        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, num_beams=1, max_length=max_length, min_length=0,
                                  repetition_penalty=1.0, no_repeat_ngram_size=0)
        if self.speculative:
            params.set_speculative_options(**self.speculative)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        return generator

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        _check_request(prompt_ids, max_new_tokens)
        start = time.perf_counter()
        generator = self._generator(prompt_ids, len(prompt_ids) + 1)
        while not generator.is_done():
            generator.generate_next_token()
        first_token_s = time.perf_counter() - start
        del generator

        start = time.perf_counter()
        generator = self._generator(prompt_ids, len(prompt_ids) + max_new_tokens)
        marks = []
        while not generator.is_done():
            generator.generate_next_token()
            marks.append(time.perf_counter())
        total_s = time.perf_counter() - start
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]
        # onnxruntime-genai stops on EOS without appending it to the sequence; the step's
        # token (get_next_tokens) is still the EOS. Include it, as the other peers do.
        last = int(generator.get_next_tokens()[0])
        if len(tokens) < max_new_tokens and last in self.eos_ids:
            tokens.append(last)
        stats = _speculative_summary(generator.get_speculative_stats()) if self.speculative else {}
        stats.update(self.build)
        return PeerRun(tokens, total_s, first_token_s, stats, decode_s=marks[-1] - marks[0] if len(marks) > 1 else None)


    def run_batch(self, prompts: list[list[int]], max_new_tokens: int) -> BatchPeerRun:
        """The prompts left-padded (with the model's pad token) into one batch of
        ``search.batch_size`` rows; onnxruntime-genai masks the padding itself."""
        import numpy as np

        if self.speculative:
            raise BadInput(f"peer {self.name}: onnxruntime-genai's speculative decoding runs one sequence")
        for prompt_ids in prompts:
            _check_request(prompt_ids, max_new_tokens)
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), self.pad_id, dtype=np.int32)
        for row, prompt_ids in enumerate(prompts):
            ids[row, width - len(prompt_ids):] = prompt_ids
        start = time.perf_counter()
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, num_beams=1, max_length=width + max_new_tokens, min_length=0,
                                  repetition_penalty=1.0, no_repeat_ngram_size=0, batch_size=len(prompts))
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        total_s = time.perf_counter() - start
        rows = []
        for row in range(len(prompts)):
            tokens = _cut([int(t) for t in generator.get_sequence(row)[width:]], self.eos_ids, max_new_tokens)
            if len(tokens) < max_new_tokens and (not tokens or tokens[-1] not in self.eos_ids):
                tokens.append(min(self.eos_ids))  # it stopped on an EOS that was not appended (see run)
            rows.append(tokens)
        return BatchPeerRun(rows, total_s)


_SPECULATIVE_KEYS = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate",
                     "target_forward_passes", "ngram_lookup_hits", "ngram_lookup_misses",
                     "standard_fallback_steps")


def _speculative_summary(stats: dict) -> dict:
    return {k: stats[k] for k in _SPECULATIVE_KEYS if k in stats}


def _import_ort_genai():
    """The module, or raise _Skip with the reason."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise _Skip(f"onnxruntime-genai is not installed: {INSTALL_HINT}")
    try:
        import onnxruntime_genai as og
    except Exception as err:  # a wheel built against another onnxruntime, a missing library
        raise _Skip(f"onnxruntime-genai cannot be imported ({_one_line(err)}): {INSTALL_HINT}") from None
    return og


def _fingerprint(src, recipe_dir: Path) -> dict:
    from specexport.exporter.sources import fingerprint

    return {"target": src.model_dump(mode="json"), "files": fingerprint(src, recipe_dir, "target")}


def _builder_options(precision: str) -> dict:
    """What the stamp records of a build besides precision and provider: the int4 options."""
    return {"int4": dict(ORT_GENAI_INT4)} if precision == "int4" else {}


def _builder_command(hf_dir: Path, out: Path, builder_cache: Path, precision: str) -> list[str]:
    """onnxruntime-genai's model builder, for the cpu execution provider at ``precision``."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(builder_cache)]
    if precision == "int4":
        cmd += ["--extra_options", *(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                     for k, v in ORT_GENAI_INT4.items())]
    return cmd


def _ort_genai_dir(og, src, recipe_dir: Path, cache_dir: Path, threads: int, loaded, precision: str = "fp32") -> Path:
    """cache_dir/ort-genai-fp32 (or -int4), built by onnxruntime-genai's model builder unless it is current."""
    name = {"fp32": ORT_GENAI_DIR, "int4": ORT_GENAI_INT4_DIR}[precision]
    out = cache_dir / name
    stamp = {"onnxruntime_genai": og.__version__, "precision": precision, "execution_provider": "cpu",
             **_builder_options(precision), **_fingerprint(src, recipe_dir)}
    if (out / "genai_config.json").is_file() and _read_json(out / ORT_GENAI_STAMP) == stamp:
        return out
    if out.exists() and not (out / ORT_GENAI_STAMP).is_file():
        raise _Skip(f"{out} exists and was not made by specexport bench; move it away to rebuild")

    cache_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = cache_dir / "hf"
    _save_hf_dir(loaded(), hf_dir)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
    log = cache_dir / f"{name}.build.log"
    cmd = _builder_command(hf_dir, work / "model", work / "builder-cache", precision)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    try:
        with log.open("w") as sink:
            done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, check=False)
        if done.returncode != 0 or not (work / "model" / "genai_config.json").is_file():
            raise _Skip(f"onnxruntime-genai's model builder failed (exit {done.returncode}): "
                        f"{_last_line(log)} (log: {log})")
        (work / "model" / ORT_GENAI_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        # an existing one is ours (it has the stamp), but for another target or version;
        # swapped in one step, the old one left in work/ for the cleanup below
        atomic.replace_dir(work / "model", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)  # only the builder's input
    return out


def _save_hf_dir(loaded, hf_dir: Path) -> None:
    """Write the fp32 target as a transformers directory (safetensors, config, tokenizer)."""
    model = loaded.model
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # A GGUF-loaded model carries its GGUF quantizer, and save_pretrained refuses it
        # (GgufHfQuantizer.is_serializable() is False). The weights are already plain fp32
        # (checked by _check_fp32), so drop the quantization config the way transformers'
        # own HfQuantizer.remove_quantization_config does.
        quantizer.remove_quantization_config(model)
    from specexport.exporter.sources import quiet_transformers

    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    with quiet_transformers():
        model.save_pretrained(str(hf_dir))
        loaded.tokenizer.save_pretrained(str(hf_dir))


def _ort_genai_pad(model_dir: Path) -> int | None:
    pad = json.loads((model_dir / "genai_config.json").read_text())["model"].get("pad_token_id")
    return int(pad[0] if isinstance(pad, list) else pad) if pad is not None else None


def _ort_genai_eos(model_dir: Path) -> list[int]:
    eos = json.loads((model_dir / "genai_config.json").read_text())["model"]["eos_token_id"]
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _load_ort_genai_model(og, model_dir: Path, threads: int):
    """The model with the thread count set on its session: the cached genai_config.json stays as
    built, and this overlay sets model.decoder.session_options for this process only."""
    config = og.Config(str(model_dir))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    return og.Model(config)


# --- llama.cpp (llama-cpp-python) ------------------------------------------------------------


class LlamaCppPeer:
    """``llama_cpp.Llama`` on the target's GGUF file (see the module docstring)."""

    def __init__(self, name: str, llama_cpp, gguf: Path, threads: int, lookup: dict | None = None):
        self.name = name
        self.threads = threads
        self.gguf = Path(gguf)
        self.lookup = dict(lookup or {})
        self._lib = llama_cpp
        self.llama: Any = None  # llama_cpp.Llama, made by _load
        self.n_ctx = 0
        self.settings = {"llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"), "gguf": self.gguf.name,
                         "search": "greedy", "n_threads": threads, "n_threads_batch": threads, **self.lookup}
        self._load(LLAMA_CPP_MIN_CTX)

    def _load(self, n_ctx: int) -> None:
        kwargs = dict(model_path=str(self.gguf), n_ctx=n_ctx, n_threads=self.threads,
                      n_threads_batch=self.threads, verbose=False)
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(**self.lookup)
        old, self.llama = self.llama, None
        if old is not None:
            old.close()  # its context and weights, before the larger one is made
        self.llama = self._lib.Llama(**kwargs)
        self._vocab = self._lib.llama_model_get_vocab(self.llama.model)
        self.n_ctx = n_ctx

    def _is_end(self, token: int) -> bool:
        """End of generation in the GGUF's vocabulary (as create_completion stops)."""
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        _check_request(prompt_ids, max_new_tokens)
        need = len(prompt_ids) + max_new_tokens
        if need > self.n_ctx:  # a larger context first, untimed
            self._load(max(LLAMA_CPP_MIN_CTX, -(-need // 256) * 256))
        llama = self.llama
        llama.reset()  # no prefix of an earlier run reused: the prompt is evaluated in every run
        tokens: list[int] = []
        marks: list[float] = []
        start = time.perf_counter()
        steps = llama.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                               reset=True)
        try:
            for token in steps:
                marks.append(time.perf_counter())
                tokens.append(int(token))
                if len(tokens) >= max_new_tokens or self._is_end(int(token)):
                    break
        finally:
            steps.close()
        total_s = time.perf_counter() - start
        stats: dict = {"n_ctx": self.n_ctx}
        draft = llama.draft_model
        if draft is not None:  # read back from the draft model in use
            stats.update(draft_model=type(draft).__name__, num_pred_tokens=draft.num_pred_tokens,
                         max_ngram_size=draft.max_ngram_size)
        return PeerRun(tokens, total_s, marks[0] - start if marks else total_s, stats,
                       decode_s=marks[-1] - marks[0] if len(marks) > 1 else None)


def gguf_file(target_source: dict, recipe_dir: Path) -> Path:
    """The GGUF file a target was built from, resolved as exporter/sources.gguf_path does (a path
    relative to the recipe's directory, or ``file`` inside the installed package ``package``,
    found without importing it), without importing the exporter. Raises _Skip: the target is not
    a GGUF, or its file is not there."""
    if target_source.get("source") != "gguf":
        raise _Skip(f"needs a GGUF target (this target's source is {target_source.get('source')!r})")
    if target_source.get("path") is not None:
        path = Path(target_source["path"])
        path = path if path.is_absolute() else Path(recipe_dir) / path
        if not path.is_file():
            raise _Skip(f"the target's GGUF file is not there: {path}")
        return path
    package, file = target_source.get("package"), target_source.get("file")
    if not package or not file:
        raise _Skip("the GGUF target names neither a path nor a package and file")
    spec = importlib.util.find_spec(package)  # finds without importing the package
    if spec is None:
        raise _Skip(f"the target's GGUF package '{package}' is not installed")
    if spec.origin is not None and spec.origin not in ("namespace", "built-in", "frozen"):
        folders = [Path(spec.origin).parent]
    else:
        folders = [Path(f) for f in (spec.submodule_search_locations or [])]
    for folder in folders:
        if (folder / file).is_file():
            return folder / file
    raise _Skip(f"'{file}' is not in package '{package}' ({', '.join(str(f) for f in folders) or 'no folder'})")


def _import_llama_cpp():
    """The module, or raise _Skip with the reason."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise _Skip(f"llama-cpp-python is not installed: {INSTALL_HINT}")
    try:
        import llama_cpp
    except Exception as err:  # a wheel built for another CPU, a missing shared library
        raise _Skip(f"llama-cpp-python cannot be imported ({_one_line(err)}): {INSTALL_HINT}") from None
    return llama_cpp


# --- the factory ---------------------------------------------------------------------------


class _Skip(Exception):
    """A peer cannot run here; the message is the one-line reason."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check_fp32(model) -> None:
    """The peers compare fp32 stacks: refuse a model whose weights are not plain fp32 tensors
    (e.g. GGUF blocks kept packed when transformers finds its GGUF kernels)."""
    import torch

    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith(("Gguf", "Ggml"))})
    if packed:
        raise _Skip(f"the target loaded with packed GGUF layers ({', '.join(packed)}), not fp32")
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if dtypes:
        raise _Skip(f"the target has {', '.join(dtypes)} weights, not fp32")


def parse_peer_names(text: str) -> list[str]:
    """``bench --peers``: a comma-separated list of PEER_NAMES, or ``all`` for every one."""
    names = list(PEER_NAMES) if text.strip() == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise BadInput(f"--peers: unknown peer {unknown[0]!r}; choose from {', '.join(PEER_NAMES)} or all")
    return list(dict.fromkeys(names))


def parse_target(target_source: dict, what: str = "target"):
    import pydantic

    from specexport.exporter.recipe import ModelSource

    try:
        return pydantic.TypeAdapter(ModelSource).validate_python(target_source)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInput(f"peers: {what} source {target_source!r}: {where}: {first['msg']}") from None


def draft_model_source(recipe: dict | None) -> dict | None:
    """The model source of a recipe's first draft model (``kind: model``; the
    transformers-assistant peer's assistant), or None."""
    for drafter in (recipe or {}).get("drafters") or []:
        if isinstance(drafter, dict) and drafter.get("kind") == "model" and isinstance(drafter.get("model"), dict):
            return drafter["model"]
    return None


def _placed(model, placement: PeerDevice):
    """The model in sdpa attention on the placement's device and dtype (a no-op for cpu/fp32)."""
    import torch

    model.set_attn_implementation("sdpa")
    if placement.device.startswith("cuda") and not torch.cuda.is_available():
        raise _Skip(f"torch sees no CUDA device for --device {placement.device}")
    return model if placement.is_default else model.to(device=placement.device, dtype=getattr(torch, placement.dtype))


def _assistant(draft_source: dict | None, recipe_dir: Path, placement: PeerDevice):
    """The recipe's draft model, placed as the target (raises _Skip without one)."""
    if draft_source is None:
        raise _Skip("the recipe has no draft model (a drafter of kind: model)")
    from specexport.exporter.sources import load_source

    return _placed(load_source(parse_target(draft_source, "draft model"), recipe_dir, "draft").model, placement)


def make_peers(target_source: dict, recipe_dir: Path, names: list[str], threads: int,
               cache_dir: Path, placement: PeerDevice | None = None,
               draft_source: dict | None = None) -> tuple[list[Peer], list[dict]]:
    """Create the named peers for the target; returns (peers, skipped), in the order of ``names``.

    ``target_source`` is the recipe's target as stored in manifest.json["recipe"]["target"];
    relative paths in it are resolved against ``recipe_dir``. Each skipped peer is
    ``{"peer": name, "skipped": reason}``. ``placement``: the transformers peers' device and
    dtype (default cpu, fp32; any other skips the CPU-only peers). ``draft_source``: the
    recipe's draft model (``draft_model_source``), transformers-assistant's assistant. Note:
    asking for a transformers peer sets ``torch.set_num_threads(threads)`` for the whole process.
    """
    placement = placement or PeerDevice()
    if threads < 1:
        raise BadInput(f"peers: threads must be at least 1 (got {threads})")
    src = parse_target(target_source)
    recipe_dir = Path(recipe_dir)
    cache_dir = Path(cache_dir)
    made: dict[str, Peer] = {}
    skipped: dict[str, str] = {}

    for name in names:
        if name not in PEER_NAMES:
            skipped[name] = f"unknown peer; known: {', '.join(PEER_NAMES)}"

    state: dict = {}

    def loaded():
        """The target in fp32 via transformers, loaded once (the ort-genai build needs it too)."""
        if "error" in state:
            raise state["error"]
        if "loaded" not in state:
            from specexport.exporter.sources import load_source

            try:
                model = load_source(src, recipe_dir, "target")
                _check_fp32(model.model)
            except Exception as err:
                state["error"] = err
                raise
            state["loaded"] = model
        return state["loaded"]

    hf_names = [n for n in names if n.startswith("transformers-") and n in PEER_NAMES]
    if hf_names:
        try:
            import torch

            torch.set_num_threads(threads)  # process-wide
            target = loaded()
            # cast in place: only the transformers peers run off the default placement (below)
            model = _placed(target.model, placement)
            from specexport.exporter.sources import eos_token_ids

            eos = eos_token_ids(target)
            pad = target.tokenizer.pad_token_id
            pad = int(pad) if pad is not None else eos[0]
            for name in hf_names:
                extra = PROMPT_LOOKUP if name.endswith("prompt-lookup") else {}
                try:
                    assistant = _assistant(draft_source, recipe_dir, placement) if name.endswith("assistant") else None
                except _Skip as why:
                    skipped[name] = str(why)
                    continue
                except Exception as err:
                    skipped[name] = f"cannot load the draft model with transformers: {_one_line(err)}"
                    continue
                made[name] = TransformersPeer(name, model, eos, pad, threads, assistant=assistant, **extra)
        except _Skip as why:
            skipped.update({n: str(why) for n in hf_names})
        except ImportError as err:
            skipped.update({n: f"transformers/torch are not installed ({err.name}): pip install 'specexport[export]'"
                            for n in hf_names})
        except Exception as err:  # the peer is optional: say why, keep benchmarking the rest
            skipped.update({n: f"cannot load the target with transformers: {_one_line(err)}" for n in hf_names})

    if not placement.is_default:  # CPU stacks: not what a GPU user would run
        for name in names:
            if name.startswith(("ort-genai", "llama-cpp")):
                skipped[name] = f"a CPU peer: runs with bench --device cpu, not on {placement.device}"
    for precision, prefix in (("fp32", "ort-genai"), ("int4", "ort-genai-int4")):
        og_names = [n for n in names if n in (prefix, f"{prefix}-ngram") and n not in skipped]
        if not og_names:
            continue
        try:
            og = _import_ort_genai()
            model_dir = _ort_genai_dir(og, src, recipe_dir, cache_dir, threads, loaded, precision)
            og_model = _load_ort_genai_model(og, model_dir, threads)
            eos = _ort_genai_eos(model_dir)
            for name in og_names:
                made[name] = OrtGenaiPeer(name, og, og_model, eos, threads,
                                          ORT_GENAI_NGRAM if name.endswith("ngram") else None,
                                          _ort_genai_pad(model_dir), precision)
        except _Skip as why:
            skipped.update({n: str(why) for n in og_names})
        except Exception as err:
            skipped.update({n: f"onnxruntime-genai model unavailable: {_one_line(err)}" for n in og_names})

    llama_names = [n for n in names if n in ("llama-cpp", "llama-cpp-lookup") and n not in skipped]
    for name in llama_names:
        try:
            gguf = gguf_file(target_source, recipe_dir)
            made[name] = LlamaCppPeer(name, _import_llama_cpp(), gguf, threads,
                                      LLAMA_CPP_LOOKUP if name.endswith("lookup") else None)
        except _Skip as why:
            skipped[name] = str(why)
        except Exception as err:
            skipped[name] = f"llama.cpp cannot load the target's GGUF: {_one_line(err)}"

    peers = [made[n] for n in dict.fromkeys(names) if n in made]
    return peers, [{"peer": n, "skipped": skipped[n]} for n in dict.fromkeys(names) if n in skipped]
