"""Peers for `specexport bench`: other inference stacks run on the same model, in fp32.

``make_peers`` makes them in the calling process; the bench runs each through
``bench/peer_process.start_peers``, in a process of its own (that module says why).

The harness interleaves their runs with ours so a reader sees where our engines stand. Each
peer generates greedily from the prompt ids it is given and reports its wall times:

- ``transformers-greedy``: ``model.generate(do_sample=False)``, sdpa attention.
- ``transformers-prompt-lookup``: the same with ``prompt_lookup_num_tokens=10`` (transformers'
  own prompt lookup; it matches n-grams of up to ``max_matching_ngram_size`` = 2 tokens).
- ``ort-genai``: onnxruntime-genai (optional: ``make bench-peers``) on an fp32 CPU model made by
  its own model builder from the target, run with greedy search.
- ``ort-genai-ngram``: the same model with onnxruntime-genai's n-gram speculative decoding
  (``ngram_size=3``: the last 2 tokens are looked up; ``max_draft_tokens=4``).

Threads: ``make_peers`` calls ``torch.set_num_threads(threads)`` when a transformers peer is
asked for. That setting is global to the process (the bench runs each peer in a process of its own); the
onnxruntime-genai peers set ``intra_op_num_threads`` on their own session.

Batched (``bench --batch``): the target-alone peers that can batch, ``transformers-greedy``
and ``ort-genai`` (``BATCHED_PEERS``), also run ``run_batch(prompts, max_new_tokens)``: one
left-padded batch of the prompts, greedy, decoded together until every row is done (static
batching: a finished row idles until the longest one ends); each row's tokens are cut after its
first EOS, as a single run's are.

The onnxruntime-genai model is built once into ``cache_dir/ort-genai-fp32`` (the target is
saved as a transformers directory in ``cache_dir/hf`` for the builder, which is removed once the
build succeeds) and reused while the target's files are unchanged.
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
from typing import Protocol

from specexport import atomic
from specexport.errors import BadInput

PEER_NAMES = ("transformers-greedy", "transformers-prompt-lookup", "ort-genai", "ort-genai-ngram")
# transformers prompt lookup: 10 candidate tokens, matching n-grams of up to 2 tokens (its default, pinned).
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}
# onnxruntime-genai's n-gram speculative options (docs/SpeculativeDecoding.md in its repository):
# ngram_size N matches the last N-1 committed tokens; max_draft_tokens is the fixed proposal width.
ORT_GENAI_NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}
ORT_GENAI_DIR = "ort-genai-fp32"
ORT_GENAI_STAMP = "specexport-peer.json"
INSTALL_HINT = "make bench-peers"
# the peers that decode a batch of prompts together (run_batch): the target alone only
BATCHED_PEERS = ("transformers-greedy", "ort-genai")


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

    def __init__(self) -> None:
        self.prompt_seen = False
        self.steps: list[tuple[float, int]] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
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
    def __init__(self, name: str, model, eos_ids: list[int], pad_id: int, threads: int, **generate_kwargs):
        self.name = name
        self.threads = threads
        self.model = model
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.generate_kwargs = generate_kwargs
        self.settings = {
            "attn_implementation": model.config._attn_implementation,
            "dtype": str(model.dtype).removeprefix("torch."),
            **generate_kwargs,
        }

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
                **self.generate_kwargs,
            )

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        import torch

        from specexport.exporter.sources import quiet_transformers

        _check_request(prompt_ids, max_new_tokens)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        mask = torch.ones_like(input_ids)
        times = _TokenTimes()  # decode timed within the run: a separate 1-token run's time,
        # subtracted, can exceed a short run's whole time on busy cores
        with quiet_transformers():
            start = time.perf_counter()
            out = self._generate(input_ids, mask, max_new_tokens, times)
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
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, prompt_ids in enumerate(prompts):
            input_ids[row, width - len(prompt_ids):] = torch.tensor(prompt_ids, dtype=torch.long)
            mask[row, width - len(prompt_ids):] = 1
        with quiet_transformers():
            start = time.perf_counter()
            out = self._generate(input_ids, mask, max_new_tokens)
            total_s = time.perf_counter() - start
        eos = set(self.eos_ids)
        return BatchPeerRun([_cut(row[width:].tolist(), eos, max_new_tokens) for row in out], total_s)


# --- onnxruntime-genai --------------------------------------------------------------------


class OrtGenaiPeer:
    def __init__(self, name: str, og, model, eos_ids: list[int], threads: int, speculative: dict | None = None,
                 pad_id: int | None = None):
        self.name = name
        self.pad_id = int(pad_id if pad_id is not None else min(eos_ids))
        self.threads = threads
        self.og = og
        self.model = model
        self.eos_ids = set(eos_ids)
        self.speculative = dict(speculative or {})
        self.settings = {"onnxruntime_genai": og.__version__, "precision": "fp32", "search": "greedy",
                         "intra_op_num_threads": threads, **self.speculative}

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


def _ort_genai_dir(og, src, recipe_dir: Path, cache_dir: Path, threads: int, loaded) -> Path:
    """cache_dir/ort-genai-fp32, built by onnxruntime-genai's model builder unless it is current."""
    out = cache_dir / ORT_GENAI_DIR
    stamp = {"onnxruntime_genai": og.__version__, "precision": "fp32", "execution_provider": "cpu",
             **_fingerprint(src, recipe_dir)}
    if (out / "genai_config.json").is_file() and _read_json(out / ORT_GENAI_STAMP) == stamp:
        return out
    if out.exists() and not (out / ORT_GENAI_STAMP).is_file():
        raise _Skip(f"{out} exists and was not made by specexport bench; move it away to rebuild")

    cache_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = cache_dir / "hf"
    _save_hf_dir(loaded(), hf_dir)
    work = Path(tempfile.mkdtemp(prefix=f".{ORT_GENAI_DIR}.", dir=cache_dir))
    log = cache_dir / f"{ORT_GENAI_DIR}.build.log"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(work / "model"),
           "-p", "fp32", "-e", "cpu", "-c", str(work / "builder-cache")]
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


def parse_target(target_source: dict):
    import pydantic

    from specexport.exporter.recipe import ModelSource

    try:
        return pydantic.TypeAdapter(ModelSource).validate_python(target_source)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInput(f"peers: target source {target_source!r}: {where}: {first['msg']}") from None


def make_peers(target_source: dict, recipe_dir: Path, names: list[str], threads: int,
               cache_dir: Path) -> tuple[list[Peer], list[dict]]:
    """Create the named peers for the target; returns (peers, skipped), in the order of ``names``.

    ``target_source`` is the recipe's target as stored in manifest.json["recipe"]["target"];
    relative paths in it are resolved against ``recipe_dir``. Each skipped peer is
    ``{"peer": name, "skipped": reason}``. Note: asking for a transformers peer sets
    ``torch.set_num_threads(threads)`` for the whole process.
    """
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
            model = target.model
            model.set_attn_implementation("sdpa")
            from specexport.exporter.sources import eos_token_ids

            eos = eos_token_ids(target)
            pad = target.tokenizer.pad_token_id
            pad = int(pad) if pad is not None else eos[0]
            for name in hf_names:
                extra = PROMPT_LOOKUP if name.endswith("prompt-lookup") else {}
                made[name] = TransformersPeer(name, model, eos, pad, threads, **extra)
        except _Skip as why:
            skipped.update({n: str(why) for n in hf_names})
        except ImportError as err:
            skipped.update({n: f"transformers/torch are not installed ({err.name}): pip install 'specexport[export]'"
                            for n in hf_names})
        except Exception as err:  # the peer is optional: say why, keep benchmarking the rest
            skipped.update({n: f"cannot load the target with transformers: {_one_line(err)}" for n in hf_names})

    og_names = [n for n in names if n.startswith("ort-genai") and n in PEER_NAMES]
    if og_names:
        try:
            og = _import_ort_genai()
            model_dir = _ort_genai_dir(og, src, recipe_dir, cache_dir, threads, loaded)
            og_model = _load_ort_genai_model(og, model_dir, threads)
            eos = _ort_genai_eos(model_dir)
            for name in og_names:
                made[name] = OrtGenaiPeer(name, og, og_model, eos, threads,
                                          ORT_GENAI_NGRAM if name.endswith("ngram") else None,
                                          _ort_genai_pad(model_dir))
        except _Skip as why:
            skipped.update({n: str(why) for n in og_names})
        except Exception as err:
            skipped.update({n: f"onnxruntime-genai model unavailable: {_one_line(err)}" for n in og_names})

    peers = [made[n] for n in dict.fromkeys(names) if n in made]
    return peers, [{"peer": n, "skipped": skipped[n]} for n in dict.fromkeys(names) if n in skipped]
