"""The runtime's Python API: load an engine directory once, generate many times.

    from specexport.runtime import load
    pipe = load("engines/smollm2-135m")
    print(pipe.generate("What is 7 * 8?", chat=True, drafter="ngram").text)
"""

from __future__ import annotations

import copy
import importlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.contract import Role
from specexport.errors import BadInput
from specexport.runtime.acceptance import Sampling
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.costs import TunedCosts, load_tuned
from specexport.runtime.decode import DecodeStats, decode
from specexport.runtime.drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from specexport.runtime.engine import EngineOptions, LazyEngine, SharedGraphs, open_kv_cache
from specexport.runtime.integrity import ensure_verified
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.manifest import DrafterEntry, EngineEntry, KVUpdate, Manifest
from specexport.runtime.memory import memory
from specexport.runtime.runner import ModelRunner, monotone_costs
from specexport.runtime.text import TextCodec


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stop_reason: str
    drafter: str
    stats: DecodeStats
    backends: dict[str, str] = field(default_factory=dict)  # model -> backend that ran it
    costs: str = "build"  # whose engine costs chose sizes and depths: "build" or "tuned (host, date)"
    first_token_s: float | None = None  # from the call to the first token
    load_to_first_token_s: float | None = None  # from load() to the first token: the pipeline's first generation only

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_ids),
            "stop_reason": self.stop_reason,
            "drafter": self.drafter,
            "backends": self.backends,
            "costs": self.costs,
            "first_token_s": _rounded(self.first_token_s),
            "load_to_first_token_s": _rounded(self.load_to_first_token_s),
            "memory": memory(),  # the process's resident memory now and at its peak
            "stats": self.stats.to_dict(),
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _ngram(entry: DrafterEntry, pipe: Pipeline) -> Drafter:
    return NgramDrafter(entry.name, int(entry.params.get("max_ngram", 3)), int(entry.params.get("min_ngram", 1)))


def _model(entry: DrafterEntry, pipe: Pipeline) -> Drafter:
    return ModelDrafter(entry.name, pipe.runner(entry.model or entry.name))


_log = logging.getLogger(__name__)
# a drafter model without engines for the pipeline's backend runs on this one (Pipeline.backend_of)
FALLBACK_BACKEND = "onnxruntime"


def _from_module(module: str) -> Callable[[DrafterEntry, Pipeline], Drafter]:
    """A factory in a runtime module (``make(entry, pipe)``), imported on first use."""

    def factory(entry: DrafterEntry, pipe: Pipeline) -> Drafter:
        return importlib.import_module(module).make(entry, pipe)

    return factory


# manifest drafter kind -> factory
DRAFTER_FACTORIES: dict[str, Callable[[DrafterEntry, Pipeline], Drafter]] = {
    "ngram": _ngram,
    "model": _model,
    "quantized-self": _model,
    # heads that read the target's hidden states (EAGLE-3 and MTP draft a chain, DFlash and
    # DSpark a block per call)
    "eagle3": _from_module("specexport.runtime.chain_drafter"),
    "mtp": _from_module("specexport.runtime.chain_drafter"),
    "dflash": _from_module("specexport.runtime.block_drafter"),
    "dspark": _from_module("specexport.runtime.block_drafter"),
}


class Pipeline:
    def __init__(self, manifest: Manifest, options: EngineOptions, backend: str, *,
                 tuned: TunedCosts | None = None, started: float | None = None):
        """``tuned``: costs measured on this machine (specexport tune), preferred over the
        build's; ``started``: perf_counter() when load() began (for load_to_first_token_s)."""
        self.manifest = manifest
        self.options = options
        self.backend = backend
        self.tuned = tuned
        self._started = started
        self.text = TextCodec(manifest.root, manifest.tokenizer)
        self._runners: dict[tuple[str, frozenset[Role] | None], ModelRunner] = {}
        self._caches: dict[str, KVCache] = {}  # model -> its one cache, shared by its runners
        self.sessions = SharedGraphs()  # graph file -> its one session, shared by the engines of its sizes
        self._batched: tuple | None = None  # (max_batch, BatchedTarget) of generate_batch, made on first use
        self.backends: dict[str, str] = {}  # model -> the backend its engines run on
        self._drafters: dict[str, Drafter] = {"none": NoDrafter()}
        self.target = self.runner("target")

    @property
    def drafter_names(self) -> list[str]:
        return ["none", *self.manifest.drafters]

    @property
    def max_seq_len(self) -> int:
        return self.manifest.models["target"].max_seq_len

    def runner(self, model: str, roles: frozenset[Role] | None = None) -> ModelRunner:
        """The model's engines and cache, created on first use (sessions once per directory).
        ``roles``: only the engines of these roles (a chain drafter's catch-up graphs and its
        step graph take different features, so each set gets its own runner); runners of one
        model share its cache."""
        key = (model, roles)
        if key not in self._runners:
            info = self.manifest.models[model]
            backend = self.backend_of(model)
            entries = [e for e in self.manifest.engines_of(model, backend) if roles is None or e.role in roles]
            # the cache first: engines of a device-resident cache bind it when they open
            if model not in self._caches:
                largest = max((e.tokens for e in self.manifest.engines_of(model, backend)), default=1)
                self._caches[model] = open_kv_cache(backend, info, self.options, largest)
            cache = self._caches[model]
            engines = [LazyEngine(e, self.manifest.root, self.options, cache, self.sessions) for e in entries]
            # The manifest's role says which graphs decoding runs (decode, catchup, verify,
            # prefill): open those now, so no session is created inside a timed round. Probe
            # graphs (the bench's cost curve) open on demand and the runner never chooses them.
            decoding = [e for e in entries if e.role.decoding]
            for entry, engine in zip(entries, engines):
                if entry.role.decoding:
                    engine.open()
            self._runners[key] = ModelRunner(model, engines, cache, {e.name: e.tokens for e in entries},
                                             {e.tokens: self.cost_ms(e) for e in decoding},
                                             frozenset(e.name for e in entries if e.kv_update == KVUpdate.IN_PLACE),
                                             roles={e.name: e.role for e in entries})
        return self._runners[key]

    def with_own_caches(self) -> Pipeline:
        """This pipeline's manifest, options, backends and sessions, with caches, runners and
        drafters of its own: what the batched loop makes per slot for a head drafter (one head
        cache per sequence; the weights stay loaded once)."""
        view = copy.copy(self)
        view._runners, view._caches, view._drafters = {}, {}, {"none": NoDrafter()}
        view._batched = None
        return view

    def cost_ms(self, entry: EngineEntry) -> float | None:
        """One run of the engine: measured on this machine by specexport tune, else at build."""
        tuned = self.tuned.ms(entry) if self.tuned is not None else None
        return tuned if tuned is not None else entry.cost_ms

    @property
    def costs_source(self) -> str:
        """Which costs the runners and the adaptive depth use: "tuned (host, date)" or "build"."""
        return self.tuned.label if self.tuned is not None else "build"

    def backend_of(self, model: str) -> str:
        """The pipeline's backend when the model has engines for it. A drafter model without
        them runs on onnxruntime beside the target (the int4 drafter's MatMulNBits graphs have
        no TensorRT importer); the target never falls back."""
        if model not in self.backends:
            if self.manifest.engines_of(model, self.backend):
                self.backends[model] = self.backend
            elif model != "target" and self.manifest.engines_of(model, FALLBACK_BACKEND):
                _log.info("model '%s' has no %s engines; it runs on %s", model, self.backend, FALLBACK_BACKEND)
                self.backends[model] = FALLBACK_BACKEND
            else:
                raise BadInput(f"{self.manifest.root}: no {self.backend} engines for model '{model}'")
        return self.backends[model]

    def drafter(self, name: str) -> Drafter:
        if name not in self._drafters:
            entry = self.manifest.drafters.get(name)
            if entry is None:
                raise BadInput(f"unknown drafter '{name}'; this engine directory has: {', '.join(self.drafter_names)}")
            factory = DRAFTER_FACTORIES.get(entry.kind)
            if factory is None:
                raise BadInput(f"drafter '{name}' is of kind '{entry.kind}', which this runtime cannot run")
            self._drafters[name] = factory(entry, self)
        return self._drafters[name]

    def _policy(self, drafter: str) -> DepthPolicy:
        """A fresh adaptive-depth policy over the engines' costs (tuned here, else the build's)."""
        target = monotone_costs({e.tokens: self.cost_ms(e) for e in self.manifest.engines_of("target", self.backend)})

        def verify_cost(tokens: int) -> float | None:
            ms = target.get(self.target.engine_size(tokens))
            return ms / 1e3 if ms else None

        entry = self.manifest.drafters.get(drafter)
        draft_ms = sync_ms = 0.0
        if entry is not None and entry.model is not None:
            engines = self.manifest.engines_of(entry.model, self.backend_of(entry.model))
            costs = {e.tokens: self.cost_ms(e) or 0.0 for e in engines}
            blocks = {e.tokens: self.cost_ms(e) for e in engines if e.role == Role.BLOCK}
            if blocks:
                # A block drafter pays one call per round whatever its depth (the round's C =
                # the smallest graph); a skipped round's rows just wait for the next call. So
                # a depth k >= 1 costs verify(1+k) + one block, depth 0 the verify alone.
                block_ms = blocks[min(blocks)]

                def with_block(tokens: int) -> float | None:
                    cost = verify_cost(tokens)
                    return cost + block_ms / 1e3 if cost and tokens > 1 and block_ms else cost

                return DepthPolicy(with_block)
            draft_ms = costs.get(1, 0.0)
            sync_ms = costs.get(2, draft_ms * 2) / 2  # skipped tokens are caught up two at a time
        return DepthPolicy(verify_cost, draft_cost=draft_ms / 1e3, sync_cost=sync_ms / 1e3)

    def _depth(self, draft_len: int | None) -> int:
        """The draft length asked for (default: the plan's D), checked against the engines'."""
        depth = self.manifest.draft_len if draft_len is None else draft_len
        if not 0 <= depth <= self.manifest.draft_len:
            raise BadInput(f"draft length must be between 0 and {self.manifest.draft_len} (got {depth})")
        return depth

    def prompt_ids(self, prompt: str | None = None, *, chat: bool = False, messages: list[dict] | None = None,
                   ids: Sequence[int] | None = None) -> list[int]:
        if ids is not None:
            result = [int(i) for i in ids]
        elif messages is not None:
            result = self.text.encode_chat(messages)
        elif prompt is None or not prompt.strip():
            raise BadInput("the prompt is empty; give some text with --prompt or --prompt-file")
        elif chat:
            result = self.text.encode_chat([{"role": "user", "content": prompt}])
        else:
            result = self.text.encode(prompt)
        if not result:
            raise BadInput("the prompt is empty after tokenization")
        if len(result) > self.max_seq_len:
            raise BadInput(
                f"the prompt has {len(result)} tokens, more than the engines' cache of {self.max_seq_len}; "
                "shorten it or rebuild with a larger shapes.max_seq_len"
            )
        return result

    def stream(self, prompt: str | None = None, *, chat: bool = False, messages: list[dict] | None = None,
               prompt_ids: Sequence[int] | None = None, drafter: str = "none", max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop: Sequence[str] = (), draft_len: int | None = None, adaptive: bool = True) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; the final Generation is the return value."""
        if max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
        ids = self.prompt_ids(prompt, chat=chat, messages=messages, ids=prompt_ids)
        sampling = Sampling(temperature, top_k, top_p)
        chosen = self.drafter(drafter)
        depth = self._depth(draft_len)
        stats = DecodeStats(draft_len=depth)
        policy = self._policy(chosen.name) if adaptive and chosen.name != "none" else None
        text = TextTracker(self.text.stream(), stop)
        out: list[int] = []
        called, first_at = time.perf_counter(), None
        for token in decode(self.target, chosen, np.asarray(ids, dtype=np.int64), draft_len=depth,
                            max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.text.eos_ids,
                            rng=np.random.default_rng(seed), stop=text.add, stats=stats, policy=policy):
            if first_at is None:
                first_at = time.perf_counter()
            out.append(token)
            if piece := text.ready():
                yield piece
        if piece := text.rest():
            yield piece
        entry = self.manifest.drafters.get(chosen.name)
        models = ["target", *([entry.model] if entry is not None and entry.model else [])]
        since_load = None
        if self._started is not None and first_at is not None:  # the first generation after load()
            since_load, self._started = first_at - self._started, None
        return Generation(text.text, out, ids, stats.stop_reason, chosen.name, stats,
                          {m: self.backend_of(m) for m in models}, self.costs_source,
                          None if first_at is None else first_at - called, since_load)

    def batched_target(self, max_batch: int | None = None):
        """The target's batched engines over one cache of max_batch rows (default: the largest
        batch size built), made on first use and kept while max_batch stays the same."""
        from specexport.runtime.batched_model import BatchedTarget

        if self.manifest.models["target"].state is not None:
            raise BadInput("the batched loop (serve, --prompts-file, bench --batch) does not run targets with "
                           "linear-attention layers (a recurrent state per sequence) yet; generate one prompt at a time")
        if self._batched is None or (max_batch is not None and max_batch != self._batched[0]):
            target = BatchedTarget(self.manifest, self.backend, self.options, self.sessions, max_batch, self.cost_ms)
            self._batched = (max_batch, target)
        return self._batched[1]

    def batch_loop(self, *, drafter: str = "none", draft_len: int | None = None, max_batch: int | None = None,
                   schedule: bool = True, per_sequence: bool = False, adaptive: bool = True, on_token=None,
                   on_round=None):
        """A continuous-batching loop (runtime/batch_decode.BatchLoop) over this pipeline's
        batched target: submit requests made by ``batch_request`` and step it. Rounds draft
        at most the manifest's depth for the number of running sequences (the plan's schedule,
        unless ``schedule`` is False) and ``draft_len``; ``per_sequence``: each round's width,
        under that cap, from every row's own acceptance and the measured batch costs; otherwise
        ``adaptive``: each sequence's own adaptive depth under it, as ``generate`` chooses it
        alone (so a request alone in the batch decodes exactly as ``generate``). Drafters: every
        kind (a drafter model needs batched graphs at every batch size the target runs; heads
        run on batched head graphs, or per row without them; runtime/batch_drafter.py says why
        one cannot run)."""
        from specexport.runtime.batch_decode import BatchLoop
        from specexport.runtime.batch_drafter import batch_drafter

        target = self.batched_target(max_batch)
        chosen = batch_drafter(self, drafter, target)  # BadInput: a drafter that cannot run batched
        policy = (lambda: self._policy(chosen.name)) if adaptive and chosen.name != "none" else None
        return BatchLoop(target, chosen, draft_len=self._depth(draft_len),
                         eos_ids=self.text.eos_ids, on_token=on_token,
                         schedule=self.manifest.draft_schedule if schedule else None,
                         per_sequence=per_sequence, on_round=on_round, adaptive=policy)

    def batch_request(self, ids: Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = ()):
        """A request for the batched loop and the text tracker that finds its stop strings
        (feed it nothing: the request's stop check does)."""
        from specexport.runtime.batch_decode import Request

        if max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
        tracker = TextTracker(self.text.stream(), stop)
        request = Request(np.asarray(self.prompt_ids(ids=ids), dtype=np.int64), max_new_tokens,
                          Sampling(temperature, top_k, top_p), np.random.default_rng(seed), tracker.add)
        return request, tracker

    def generate_batch(self, prompts: Sequence[str | dict | Sequence[int]], *, chat: bool = False,
                       drafter: str = "none", max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                       draft_len: int | None = None, max_batch: int | None = None,
                       schedule: bool = True, per_sequence: bool = False, adaptive: bool = True) -> list[Generation]:
        """Decode many prompts together (runtime/batch_decode.py): up to ``max_batch`` (default:
        the largest batch size built) share each verify pass, joining as others finish. A prompt
        is text, a {"messages": [...]} or {"prompt": "..."} record (the bench's format), or token
        ids. Each result is what ``generate`` gives for that prompt alone (greedy: the same
        tokens). Sequence i samples with seed ``seed + i``. Depth: as ``batch_loop``."""
        loop = self.batch_loop(drafter=drafter, draft_len=draft_len, max_batch=max_batch, schedule=schedule,
                               per_sequence=per_sequence, adaptive=adaptive)
        trackers, ids_of = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict):
                ids = self.prompt_ids(prompt.get("prompt"), chat=chat, messages=prompt.get("messages"))
            elif isinstance(prompt, str):
                ids = self.prompt_ids(prompt, chat=chat)
            else:
                ids = self.prompt_ids(ids=prompt)
            request, tracker = self.batch_request(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                  top_k=top_k, top_p=top_p,
                                                  seed=None if seed is None else seed + i, stop=stop)
            loop.submit(i, request)
            trackers.append(tracker)
            ids_of.append(ids)
        done = {}
        while loop.busy:
            done.update(loop.step())
        entry = self.manifest.drafters.get(loop.drafter.name)
        models = ["target", *([entry.model] if entry is not None and entry.model else [])]
        return [Generation(tracker.text, done[i].tokens, ids, done[i].stats.stop_reason, loop.drafter.name,
                           done[i].stats, {m: self.backend_of(m) for m in models}, self.costs_source)
                for i, (tracker, ids) in enumerate(zip(trackers, ids_of))]

    def generate(self, prompt: str | None = None, **kwargs) -> Generation:
        stream = self.stream(prompt, **kwargs)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value


class TextTracker:
    """Detokenizes as tokens arrive and finds stop strings. Text is released only once no
    stop string can still begin in it, so a stream never shows part of one; a stop string
    and what follows it are cut off."""

    def __init__(self, detokenize: Callable[[int], str | None], stops: Sequence[str]):
        self.detokenize = detokenize
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Append the token's text; True when a stop string is now complete."""
        piece = self.detokenize(token) or ""
        search_from = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def ready(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def rest(self) -> str:
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece


def load(engine_dir: str | Path, *, threads: int | None = None, device: str = "cpu", backend: str | None = None,
         verify: bool = True, device_kv: bool = True, tuned_costs: bool = True) -> Pipeline:
    """Open an engine directory: check its manifest and file hashes, create the sessions.
    Hashes are checked in full on first use and then only for files whose size, times or inode
    changed (runtime/integrity.py; ``specexport verify`` checks everything).
    ``device_kv``: with the tensorrt backend, keep the KV caches on the GPU (False: in host
    memory, copied to the GPU on every run). ``tuned_costs``: prefer the costs measured by
    ``specexport tune`` on this machine over the build's."""
    started = time.perf_counter()
    manifest = Manifest.load(engine_dir)
    if verify:
        ensure_verified(manifest)
    available = manifest.backends()
    chosen = backend or ("onnxruntime" if "onnxruntime" in available else available[0])
    if chosen not in available:
        hint = f"; build them on this machine with: specexport build --from-onnx {engine_dir}" if chosen == "tensorrt" else ""
        raise BadInput(f"{engine_dir}: no engines for backend '{chosen}' (it has: {', '.join(available)}){hint}")
    return Pipeline(manifest, EngineOptions(threads=threads, device=device, device_kv=device_kv), chosen,
                    tuned=load_tuned(manifest) if tuned_costs else None, started=started)
