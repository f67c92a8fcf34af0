"""The runtime's Python API: load an engine directory once, generate many times.

    from specexport.runtime import load
    pipe = load("engines/smollm2-135m")
    print(pipe.generate("What is 7 * 8?", chat=True, drafter="ngram").text)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import BadInput
from specexport.runtime.acceptance import Sampling
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.decode import DecodeStats, decode
from specexport.runtime.drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from specexport.runtime.engine import EngineOptions, LazyEngine
from specexport.runtime.kv_cache import KVCache
from specexport.runtime.manifest import DrafterEntry, Manifest
from specexport.runtime.runner import ModelRunner
from specexport.runtime.text import TextCodec


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stop_reason: str
    drafter: str
    stats: DecodeStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_ids),
            "stop_reason": self.stop_reason,
            "drafter": self.drafter,
            "stats": self.stats.to_dict(),
        }


def _ngram(entry: DrafterEntry, pipe: Pipeline) -> Drafter:
    return NgramDrafter(entry.name, int(entry.params.get("max_ngram", 3)), int(entry.params.get("min_ngram", 1)))


def _model(entry: DrafterEntry, pipe: Pipeline) -> Drafter:
    return ModelDrafter(entry.name, pipe.runner(entry.model or entry.name))


# manifest drafter kind -> factory
DRAFTER_FACTORIES: dict[str, Callable[[DrafterEntry, Pipeline], Drafter]] = {
    "ngram": _ngram,
    "model": _model,
    "quantized-self": _model,
}


class Pipeline:
    def __init__(self, manifest: Manifest, options: EngineOptions, backend: str):
        self.manifest = manifest
        self.options = options
        self.backend = backend
        self.text = TextCodec(manifest.root, manifest.tokenizer)
        self._runners: dict[str, ModelRunner] = {}
        self._drafters: dict[str, Drafter] = {"none": NoDrafter()}
        self.target = self.runner("target")

    @property
    def drafter_names(self) -> list[str]:
        return ["none", *self.manifest.drafters]

    @property
    def max_seq_len(self) -> int:
        return self.manifest.models["target"].max_seq_len

    def runner(self, model: str) -> ModelRunner:
        """The model's engines and cache, created on first use (sessions once per directory)."""
        if model not in self._runners:
            info = self.manifest.models[model]
            entries = self.manifest.engines_of(model, self.backend)
            if not entries:
                raise BadInput(f"{self.manifest.root}: no {self.backend} engines for model '{model}'")
            engines = [LazyEngine(e, self.manifest.root, self.options) for e in entries]
            # Decoding uses the sizes up to 1+D and the prefill chunk: open those now, so no
            # session is created inside a timed round. Probe graphs (the bench's cost curve)
            # open on demand and are left out of the runner's choice of engines.
            largest = max(e.tokens for e in entries)
            used = {e.tokens for e in entries if e.tokens <= self.manifest.draft_len + 1 or e.tokens == largest}
            for entry, engine in zip(entries, engines):
                if entry.tokens in used:
                    engine.open()
            cache = KVCache(info.num_layers, 1, info.num_kv_heads, info.max_seq_len, info.head_dim, info.kv_dtype)
            self._runners[model] = ModelRunner(model, engines, cache, {e.name: e.tokens for e in entries},
                                               {e.tokens: e.cost_ms for e in entries if e.tokens in used},
                                               frozenset(e.name for e in entries if e.kv_update == "in_place"))
        return self._runners[model]

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
        """A fresh adaptive-depth policy over the costs the build measured."""
        target = {e.tokens: e.cost_ms for e in self.manifest.engines_of("target", self.backend)}

        def verify_cost(tokens: int) -> float | None:
            ms = target.get(self.target.engine_size(tokens))
            return ms / 1e3 if ms else None

        entry = self.manifest.drafters.get(drafter)
        draft_ms = sync_ms = 0.0
        if entry is not None and entry.model is not None:
            costs = {e.tokens: e.cost_ms or 0.0 for e in self.manifest.engines_of(entry.model, self.backend)}
            draft_ms = costs.get(1, 0.0)
            sync_ms = costs.get(2, draft_ms * 2) / 2  # skipped tokens are caught up two at a time
        return DepthPolicy(verify_cost, draft_cost=draft_ms / 1e3, sync_cost=sync_ms / 1e3)

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
        depth = self.manifest.draft_len if draft_len is None else draft_len
        if not 0 <= depth <= self.manifest.draft_len:
            raise BadInput(f"draft length must be between 0 and {self.manifest.draft_len} (got {depth})")
        stats = DecodeStats(draft_len=depth)
        policy = self._policy(chosen.name) if adaptive and chosen.name != "none" else None
        text = _TextTracker(self.text.stream(), stop)
        out: list[int] = []
        for token in decode(self.target, chosen, np.asarray(ids, dtype=np.int64), draft_len=depth,
                            max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.text.eos_ids,
                            rng=np.random.default_rng(seed), stop=text.add, stats=stats, policy=policy):
            out.append(token)
            if piece := text.ready():
                yield piece
        if piece := text.rest():
            yield piece
        return Generation(text.text, out, ids, stats.stop_reason, chosen.name, stats)

    def generate(self, prompt: str | None = None, **kwargs) -> Generation:
        stream = self.stream(prompt, **kwargs)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value


class _TextTracker:
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
         verify: bool = True) -> Pipeline:
    """Open an engine directory: check its manifest and file hashes, create the sessions."""
    manifest = Manifest.load(engine_dir)
    if verify:
        manifest.verify_files()
    available = manifest.backends()
    chosen = backend or ("onnxruntime" if "onnxruntime" in available else available[0])
    if chosen not in available:
        hint = f"; build them on this machine with: specexport build --from-onnx {engine_dir}" if chosen == "tensorrt" else ""
        raise BadInput(f"{engine_dir}: no engines for backend '{chosen}' (it has: {', '.join(available)}){hint}")
    return Pipeline(manifest, EngineOptions(threads=threads, device=device), chosen)
