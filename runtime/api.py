"""The runtime's Python API: load an engine directory once, generate many times.

    from specexport.runtime import load
    pipe = load("engines/smollm2-135m")
    print(pipe.generate("What is 7 * 8?", chat=True, drafter="ngram").text)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.backends import BACKENDS, DEFAULT_BACKEND, TENSORRT
from specexport.contract import Manifest, Role
from specexport.errors import BadInput
from specexport.runtime.acceptance import Sampling
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.copy_counter import CopyCounter
from specexport.runtime.cost_policy import EngineCosts
from specexport.runtime.costs import TunedCosts, load_tuned
from specexport.runtime.drafter_factories import make_drafter
from specexport.runtime.drafter_set import DrafterSet
from specexport.runtime.drafters import Drafter, NoDrafter
from specexport.runtime.engine import EngineOptions, SharedGraphs
from specexport.runtime.grammar import Grammars
from specexport.runtime.input_checks import (
    HEAD_KINDS,
    batched_refusal,
    built_tree_nodes,
    check_draft_len,
    check_drafter,
    check_tree_nodes,
    target_batches,
)
from specexport.runtime.integrity import ensure_verified
from specexport.runtime.logprobs import Logprobs, TokenLogprob
from specexport.runtime.loop import BatchLoop, Request
from specexport.runtime.memory import memory
from specexport.runtime.model import Model, SlotCaches, open_caches, open_model, slots_refusal
from specexport.runtime.rules import Controls, SequenceRules
from specexport.runtime.runner import ModelRunner
from specexport.runtime.spec_metrics import speculative_decoding
from specexport.runtime.stats import DecodeStats
from specexport.runtime.suffix_store import ResponseStore
from specexport.runtime.text import TextCodec
from specexport.runtime.tree_verifier_factory import open_tree_verifier
from specexport.runtime.tree_verify import TreeVerifier


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
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for (Controls.logprobs)

    def speculative_decoding(self, detailed: bool = False) -> dict:
        """This request's speculation stats in vLLM's per-request shape (runtime/spec_metrics.py)."""
        return speculative_decoding([self.stats], detailed)

    def to_dict(self) -> dict:
        logprobs = None if self.logprobs is None else [
            {"token": e.token, "logprob": round(e.logprob, 6), "top": [[t, round(lp, 6)] for t, lp in e.top]}
            for e in self.logprobs]
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
            "speculative_decoding": self.speculative_decoding(),
            **({"logprobs": logprobs} if logprobs is not None else {}),
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


_log = logging.getLogger(__name__)
__all__ = ["Generation", "Pipeline", "TextTracker", "load",
           # input checks (input_checks.py) that tests/runtime/test_tree.py and test_batch_drafter.py import from here
           "HEAD_KINDS", "batched_refusal", "check_tree_nodes"]


class Pipeline:
    def __init__(self, manifest: Manifest, options: EngineOptions, backend: str, *,
                 tuned: TunedCosts | None = None, started: float | None = None, check_prices: bool = True,
                 store_tokens: int | None = None):
        """``tuned``: costs measured on this machine (specexport tune), preferred over the
        build's; ``started``: perf_counter() when load() began (for load_to_first_token_s);
        ``check_prices``: adaptive depth checks its round prices against the clock
        (runtime/round_prices.py; False: fixed prices, so a seeded run repeats its choices);
        ``store_tokens``: the token budget of a suffix drafter's store of earlier responses (0: no
        store; None: the drafter's recipe setting)."""
        self.manifest = manifest
        self.options = options
        self.backend = backend
        self.costs = EngineCosts(manifest, tuned, self.backend_of, check_prices)
        self._started = started
        self.text = TextCodec(manifest.root, manifest.tokenizer)
        self._grammars: Grammars | None = None
        self._trees: dict[int, TreeVerifier | None] = {}  # target slots -> its tree verifier
        self.sessions = SharedGraphs()  # graph file -> its one session, shared by the engines of its sizes
        self.backends: dict[str, str] = {}  # model -> the backend its engines run on
        self._caches: dict[tuple[str, int], SlotCaches] = {}  # (model, slots) -> its one cache
        self._models: dict[tuple, Model] = {}
        self._drafters: dict[tuple[str, int], Drafter] = {}
        self.store_tokens = store_tokens
        # a suffix drafter's store of earlier responses, by drafter name: one per pipeline, shared
        # by its loops of every size (generate, generate_batch, a server's loop)
        self.stores: dict[str, ResponseStore] = {}
        self.target = self.runner("target")

    @property
    def drafter_names(self) -> list[str]:
        return ["none", *self.manifest.drafters]

    @property
    def copies(self) -> CopyCounter:
        """Bytes this load's engines and cache stores copied between host and device so far
        (runtime/copy_counter.py): cache tensors apart from the rest, per direction."""
        return self.sessions.copies

    @property
    def max_seq_len(self) -> int:
        return self.manifest.models["target"].max_seq_len

    def model(self, name: str, roles: frozenset[Role] | None = None, slots: int = 1, make_runner=None) -> Model:
        """The model's graphs of ``roles`` (None: all) over its cache of ``slots`` rows, opened on
        first use (runtime/model.py); models of one name and slots share that cache."""
        key = (name, roles, slots)
        if key not in self._models:
            backend = self.backend_of(name)
            refusal = slots_refusal(self.manifest, name, backend, [slots], roles)
            if refusal is not None:
                raise BadInput(f"{self.manifest.root}: {refusal}")
            # the cache first: engines of a device cache bind it
            self._models[key] = open_model(self.manifest, name, backend, self.options, self.sessions,
                                           self.caches(name, slots), roles, self.costs.ms, make_runner)
        return self._models[key]

    def caches(self, name: str, slots: int = 1) -> SlotCaches:
        """The model's cache of ``slots`` rows, opened on first use: every graph of the model over
        that many rows binds it, and a drafter that takes the target's K/V reads it."""
        if (name, slots) not in self._caches:
            backend = self.backend_of(name)
            largest = max((e.tokens for e in self.manifest.engines_of(name, backend)), default=1)
            self._caches[(name, slots)] = open_caches(self.manifest.models[name], backend, self.options, slots,
                                                      largest, self.sessions.copies)
        return self._caches[(name, slots)]

    def runner(self, model: str, roles: frozenset[Role] | None = None) -> ModelRunner:
        """The model's batch-1 runner (the bench's cost curve, tune, build's timing)."""
        return self.model(model, roles).runners[0]

    def costs_by_role(self, model: str) -> dict[Role, dict[int, float]]:
        """role -> tokens -> ms of one batch-1 run of the model's graphs (0 where unmeasured); the
        head drafters' factories (chain_drafter.make, block_drafter.make) read it."""
        return self.costs.by_role(model)

    @property
    def costs_source(self) -> str:
        """Which costs the runners and the adaptive depth use: "tuned (host, date)" or "build"."""
        return self.costs.source

    def backend_of(self, model: str) -> str:
        """The pipeline's backend when the model has engines for it. A drafter model without
        them runs on the backend's fallback beside the target (specexport/backends.py); the
        target never falls back."""
        if model not in self.backends:
            if self.manifest.engines_of(model, self.backend):
                self.backends[model] = self.backend
            elif model != "target" and self.manifest.engines_of(model, fallback := BACKENDS[self.backend].fallback):
                _log.info("model '%s' has no %s engines; it runs on %s", model, self.backend, fallback)
                self.backends[model] = fallback
            else:
                raise BadInput(f"{self.manifest.root}: no {self.backend} engines for model '{model}'")
        return self.backends[model]

    def tree_verifier(self, target: Model) -> TreeVerifier | None:
        """The target's tree verify graphs over its slots, at every batch size built up to them
        (None: the directory has none)."""
        if target.slots not in self._trees:
            self._trees[target.slots] = open_tree_verifier(self.manifest, self.backend_of("target"), target,
                                                           self.options, self.sessions, self.costs.ms)
        return self._trees[target.slots]

    def tree_nodes(self, asked: int | None, drafter: str | None = None) -> int:
        """Draft nodes per tree round: ``asked`` (0: chains), default the recipe's (draft.tree) where
        it names ``drafter`` among the drafters decoding trees (``check_tree_nodes``)."""
        return check_tree_nodes(self.manifest, asked, drafter)

    @property
    def built_tree_nodes(self) -> int:
        """The tree graph's draft nodes (0: none built): the most --tree-nodes can ask."""
        return built_tree_nodes(self.manifest)

    @property
    def grammars(self) -> Grammars:
        """Grammar compilation for this directory's tokenizer and the target's vocabulary (made on first use)."""
        if self._grammars is None:
            tokenizer = (self.manifest.root / self.manifest.tokenizer["file"]).read_text()
            self._grammars = Grammars(tokenizer, self.manifest.models["target"].vocab_size, self.text.eos_ids)
        return self._grammars

    def drafter(self, name: str, slots: int = 1) -> Drafter:
        """The drafter ``name`` over a loop of ``slots`` rows, made once."""
        if (name, slots) not in self._drafters:
            if name == "none":
                self._drafters[(name, slots)] = NoDrafter()
                return self._drafters[(name, slots)]
            check_drafter(self.manifest, name, slots, backend=self.backend)
            entry = self.manifest.drafter_entry(name)
            assert entry is not None  # check_drafter refused an unknown name
            self._drafters[(name, slots)] = make_drafter(self, entry, slots)
        return self._drafters[(name, slots)]

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
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               seed: int | None = None, stop: Sequence[str] = (), draft_len: int | None = None, adaptive: bool = True,
               controls: Controls | None = None, tree_nodes: int | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; the final Generation is the return value.
        One request is the decode loop with one slot. ``controls``: penalties, a grammar, logprobs.
        ``tree_nodes``: draft nodes per round as a token tree, where the drafter builds trees
        (0: chains; default: the recipe's draft.tree)."""
        if max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
        ids = self.prompt_ids(prompt, chat=chat, messages=messages, ids=prompt_ids)
        request, text = self.batch_request(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                           top_p=top_p, min_p=min_p, seed=seed, stop=stop, controls=controls)
        out: list[int] = []
        loop = self.batch_loop(drafter=drafter, draft_len=draft_len, max_batch=1, schedule=False, adaptive=adaptive,
                               on_token=lambda key, token: out.append(token), tree_nodes=tree_nodes)
        loop.submit(0, request)
        called, first_at, done = time.perf_counter(), None, []
        for ended in loop.run():
            done += ended
            if first_at is None and out:
                first_at = time.perf_counter()
            if piece := text.ready():
                yield piece
        if piece := text.rest():
            yield piece
        stats = done[0][1].stats
        since_load = None
        if self._started is not None and first_at is not None:  # the first generation after load()
            since_load, self._started = first_at - self._started, None
        return Generation(text.text, out, ids, stats.stop_reason, loop.drafter.name, stats,
                          self._backends_of(loop.drafter.name), self.costs_source,
                          None if first_at is None else first_at - called, since_load,
                          None if request.logprobs is None else request.logprobs.entries)

    def _backends_of(self, drafter: str) -> dict[str, str]:
        entry = self.manifest.drafter_entry(drafter)
        models = ["target", *([entry.model] if entry is not None and entry.model else [])]
        return {m: self.backend_of(m) for m in models}

    def batched_target(self, max_batch: int | None = None) -> Model:
        """The target over one slot per sequence the loop may run (default: the largest batch size built)."""
        return self.model("target", slots=max(target_batches(self.manifest, max_batch)))

    def batch_loop(self, *, drafter: str | Sequence[str] = "none", draft_len: int | None = None,
                   max_batch: int | None = None, schedule: bool = True, per_sequence: bool = False,
                   adaptive: bool = True, on_token=None, on_round=None, tree_nodes: int | None = None) -> BatchLoop:
        """A continuous-batching loop (runtime/loop.BatchLoop) over the target's slots: submit
        requests made by ``batch_request`` and step it. Rounds draft at most the manifest's depth
        for the number of running sequences (the plan's schedule, unless ``schedule`` is False)
        and ``draft_len``; ``adaptive``: each sequence's own adaptive depth under it (so a
        request alone in the batch decodes exactly as ``generate``); ``per_sequence``: then each
        round's batch-wide verify width from every row's acceptance and the measured batch
        costs. Every drafter kind runs batched where the directory has its graphs at each batch
        size (``batched_refusal`` says why not). Several ``drafter`` names: a DrafterSet
        (runtime/drafter_set.py), each request drafting with the one its ``Request.drafter``
        names (default the first); its rounds draft chains unless every one builds trees."""
        target = self.batched_target(max_batch)
        names = [drafter] if isinstance(drafter, str) else list(dict.fromkeys(drafter))
        members = {name: self.drafter(name, target.slots) for name in names}
        chosen: Drafter = members[names[0]] if len(names) == 1 else DrafterSet(members, target.slots)

        def depth_policy(member: Drafter = chosen) -> DepthPolicy:  # a set's: given the sequence's member
            return self.costs.depth_policy(member, self.target)

        policy = depth_policy if adaptive and chosen.name != "none" else None
        nodes = min(self.tree_nodes(tree_nodes, name) for name in names)
        return BatchLoop(target, chosen, draft_len=check_draft_len(self.manifest, draft_len),
                         eos_ids=self.text.eos_ids, on_token=on_token,
                         schedule=self.manifest.draft_schedule if schedule else None,
                         per_sequence=per_sequence, on_round=on_round, adaptive=policy,
                         tree_verifier=self.tree_verifier(target) if nodes else None, tree_nodes=nodes,
                         tree_top_k=int(self.manifest.plan.get("tree_top_k", 4)),
                         prices=self.costs.round_prices(target.slots) if policy is not None else None)

    def batch_request(self, ids: Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                      stop: Sequence[str] = (), controls: Controls | None = None,
                      max_depth: int | None = None, drafter: str | None = None) -> tuple[Request, TextTracker]:
        """A request for the loop and the text tracker that finds its stop strings (the request's
        stop check feeds it each token). ``controls``: its penalties, grammar and logprobs;
        ``max_depth``: at most this many drafts a round for this request (0: none; None: the loop's);
        ``drafter``: in a loop of several drafters, the one drafting for it (None: the first)."""
        if max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
        prompt = np.asarray(self.prompt_ids(ids=ids), dtype=np.int64)
        sampling = Sampling(temperature, top_k, top_p, min_p)
        controls = controls or Controls()
        rules = None
        if controls.rules_logits:
            controls.penalties.check_vocab(self.manifest.models["target"].vocab_size)
            grammar = self.grammars.start(controls.grammar) if controls.grammar is not None else None
            rules = SequenceRules(controls.penalties, prompt, self.text.eos_ids, grammar)
        tracker = TextTracker(self.text.stream(), stop)
        request = Request(prompt, max_new_tokens, sampling, np.random.default_rng(seed), tracker.add, rules,
                          None if controls.logprobs is None else Logprobs(controls.logprobs), max_depth, drafter)
        return request, tracker

    def generate_batch(self, prompts: Sequence[str | dict | Sequence[int]], *, chat: bool = False,
                       drafter: str = "none", max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop: Sequence[str] = (),
                       draft_len: int | None = None, max_batch: int | None = None,
                       schedule: bool = True, per_sequence: bool = False, adaptive: bool = True,
                       controls: Controls | None = None, tree_nodes: int | None = None) -> list[Generation]:
        """Decode many prompts together: up to ``max_batch`` (default: the largest batch size
        built) share each verify pass, joining as others finish. A prompt is text, a
        {"messages": [...]} or {"prompt": "..."} record (the bench's format), or token ids. Each
        result is what ``generate`` gives for that prompt alone (greedy: the same tokens).
        Sequence i samples with seed ``seed + i``. Depth and ``tree_nodes``: as ``batch_loop``."""
        loop = self.batch_loop(drafter=drafter, draft_len=draft_len, max_batch=max_batch, schedule=schedule,
                               per_sequence=per_sequence, adaptive=adaptive, tree_nodes=tree_nodes)
        trackers, ids_of, requests = [], [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict):
                ids = self.prompt_ids(prompt.get("prompt"), chat=chat, messages=prompt.get("messages"))
            elif isinstance(prompt, str):
                ids = self.prompt_ids(prompt, chat=chat)
            else:
                ids = self.prompt_ids(ids=prompt)
            request, tracker = self.batch_request(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                  top_k=top_k, top_p=top_p, min_p=min_p,
                                                  seed=None if seed is None else seed + i, stop=stop, controls=controls)
            loop.submit(i, request)
            trackers.append(tracker)
            ids_of.append(ids)
            requests.append(request)
        done = {key: finished for ended in loop.run() for key, finished in ended}
        backends = self._backends_of(loop.drafter.name)
        return [Generation(tracker.text, done[i].tokens, ids, done[i].stats.stop_reason, loop.drafter.name,
                           done[i].stats, backends, self.costs_source,
                           logprobs=None if request.logprobs is None else request.logprobs.entries)
                for i, (tracker, ids, request) in enumerate(zip(trackers, ids_of, requests))]

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
         verify: bool = True, device_kv: bool = True, tuned_costs: bool = True, check_prices: bool = True,
         device_store: bool = False, cuda_graphs: bool = False, store_tokens: int | None = None) -> Pipeline:
    """Open an engine directory: check its manifest and file hashes, create the sessions.
    Hashes are checked in full on first use and then only for files whose size, times or inode
    changed (runtime/integrity.py; ``specexport verify`` checks everything).
    ``device``: onnxruntime's execution provider, cpu or cuda ("tensorrt" is the old spelling of
    ``backend="tensorrt"``, the one TensorRT path). ``device_kv``: with the tensorrt backend,
    keep the KV caches on the GPU (False: in host memory, copied to the GPU on every run).
    ``tuned_costs``: prefer the costs measured by ``specexport tune`` on this machine over the
    build's. ``check_prices``: adaptive depth replaces a round price the clock disagrees with
    (False: the costs as they are, so seeded runs choose the same depths every time).
    ``device_store``: onnxruntime keeps the caches in a device store (OrtValues bound by address,
    runtime/device_store.py) on the CPU too; with ``device="cuda"`` it always does.
    ``cuda_graphs``: on cuda (either backend), capture each static shape's run as a CUDA graph
    and replay it.
    ``store_tokens``: a suffix drafter's store of earlier responses holds at most this many
    tokens (0: none; None: the drafter's recipe setting)."""
    started = time.perf_counter()
    if device == TENSORRT:
        if backend not in (None, TENSORRT):
            raise BadInput(f"--device tensorrt is --backend tensorrt, not --backend {backend}; give one of them")
        backend, device = TENSORRT, "cpu"
    manifest = Manifest.load(engine_dir)
    if verify:
        ensure_verified(manifest)
    available = manifest.backends()
    chosen = backend or (DEFAULT_BACKEND if DEFAULT_BACKEND in available else available[0])
    if chosen not in available:
        hint = BACKENDS[chosen].missing_hint.format(dir=engine_dir) if chosen in BACKENDS else ""
        raise BadInput(f"{engine_dir}: no engines for backend '{chosen}' (it has: {', '.join(available)}){hint}")
    options = EngineOptions(threads=threads, device=device, device_kv=device_kv, device_store=device_store,
                            cuda_graphs=cuda_graphs)
    return Pipeline(manifest, options, chosen, tuned=load_tuned(manifest) if tuned_costs else None, started=started,
                    check_prices=check_prices, store_tokens=store_tokens)
