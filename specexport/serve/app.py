"""The FastAPI app: OpenAI's completions and chat completions over the engine thread.

The engine directory loads in the lifespan, in a thread, so the port answers at once: /health
and the completion routes say 503 until the engine is ready. Request bodies are read and
checked here (not by FastAPI's automatic validation) so every bad request gets OpenAI's error
body with the status a client can act on: 400 bad field, 401 wrong key, 404 unknown model or
route, 413 too long, 429 queue full, 503 loading. Nothing a request sends reaches the engine
thread unchecked: a bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specexport.errors import SpecexportError
from specexport.runtime.logprobs import TokenLogprob
from specexport.runtime.rules import Controls
from specexport.runtime.spec_metrics import speculative_decoding
from specexport.runtime.stats import DecodeStats
from specexport.serve.config import ServeConfig
from specexport.serve.engine_loop import EngineThread, Event, Job, Params, QueueFull
from specexport.serve.metrics import ServerMetrics
from specexport.serve.protocol import ApiError, ChatRequest, CompletionRequest

_log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 * 1024 * 1024  # more than any prompt the engines can hold
# bodies read at once, and how long one may take: at most BODY_READERS x MAX_BODY_BYTES of
# request bodies are in memory however many clients send, and a client that trickles its body
# holds a reader for BODY_SECONDS at most
BODY_READERS = 2
BODY_SECONDS = 10.0
_SERVED_BY = f"{socket.gethostname()}:{os.getpid()}"  # which process answered (Ray replicas differ)


def default_loader(config: ServeConfig):
    from specexport.runtime import load

    return load(config.engine_dir, threads=config.threads, check_prices=config.check_prices, backend=config.backend,
                store_tokens=config.store_tokens)


class ServerState:
    """The loaded pipeline, its engine thread and metrics; or why they are not there yet."""

    def __init__(self, config: ServeConfig, loader: Callable[[ServeConfig], object]):
        self.config, self.loader = config, loader
        self.pipe = None
        self.engine: EngineThread | None = None
        self.metrics: ServerMetrics | None = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.readers = asyncio.Semaphore(BODY_READERS)  # request bodies being read (_read_body)
        self._loading = threading.Thread(target=self._load, name="specexport-load", daemon=True)

    def start(self) -> None:
        self._loading.start()

    def _load(self) -> None:
        try:
            pipe = self.loader(self.config)
            loop = pipe.batch_loop(drafter=self.config.drafters, max_batch=self.config.max_batch,
                                   schedule=self.config.schedule, per_sequence=self.config.per_sequence,
                                   adaptive=self.config.adaptive, tree_nodes=self.config.tree_nodes)
            self.metrics = ServerMetrics(self.config.served_name, pipe.manifest.draft_len)
            self.metrics.watch_stores(pipe.stores)
            engine = EngineThread(pipe, loop, self.metrics, self.config.max_waiting)
            engine.start()
            self.pipe, self.engine = pipe, engine
        except SpecexportError as err:
            self.error = str(err)
        except Exception as err:  # noqa: BLE001 - reported by /health and every request
            _log.exception("loading %s failed", self.config.engine_dir)
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.loaded.set()

    def stop(self) -> None:
        self._loading.join(timeout=120)
        if self.engine is not None:
            self.engine.stop()

    def ready_engine(self) -> EngineThread:
        if self.error is not None:
            raise ApiError(503, f"the engine failed to load: {self.error}", kind="server_error", code="engine_failed")
        if self.engine is None:
            raise ApiError(503, "the engine is still loading; retry shortly", kind="server_error", code="loading")
        if not self.engine.alive:
            raise ApiError(503, "the engine thread has stopped", kind="server_error", code="engine_stopped")
        return self.engine


def create_app(config: ServeConfig, *, loader: Callable[[ServeConfig], object] | None = None) -> FastAPI:
    """The server for one engine directory. ``loader(config) -> Pipeline`` (default:
    specexport.runtime.load with the config's threads)."""
    state = ServerState(config, loader or default_loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield
        await asyncio.to_thread(state.stop)

    app = FastAPI(title="specexport", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        if state.metrics is not None:
            state.metrics.reject(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers={"x-served-by": _SERVED_BY})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(ApiError(err.status_code, str(err.detail), code=str(err.status_code)).body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        _log.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}", kind="server_error").body(),
                            status_code=500)

    expected_auth = None if config.api_key is None else f"Bearer {config.api_key}".encode()

    def authorize(request: Request) -> None:
        if expected_auth is None:
            return
        # constant time: how long the comparison takes says nothing about how much of a guess was right
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected_auth):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok", "backend": getattr(state.pipe, "backend", None)}  # the engines it serves

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            state.ready_engine()
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        max_len = state.pipe.max_seq_len if state.pipe is not None else None
        return {"object": "list", "data": [{"id": config.served_name, "object": "model", "created": 0,
                                            "owned_by": "specexport", "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await _parse(request, CompletionRequest)
        engine = state.ready_engine()
        ids = _encode(state, lambda: _completion_ids(state, body.prompt), "prompt")
        return await _respond(request, state, engine, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await _parse(request, ChatRequest)
        engine = state.ready_engine()
        messages = [m.as_template_input() for m in body.messages]
        as_text = not config.special_tokens_in_content
        ids = _encode(state, lambda: state.pipe.text.encode_chat(messages, content_as_text=as_text), "messages")
        return await _respond(request, state, engine, body, ids, body.token_budget, chat=True)

    return app


async def _read_body(request: Request) -> bytearray:
    """The body, never more than MAX_BODY_BYTES of it in memory: a declared Content-Length over
    the limit is refused before reading, a stream (chunked, or lying about its length) is cut as
    soon as it passes the limit, and BODY_READERS bodies are read at a time (ServerState.readers)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes, more than {MAX_BODY_BYTES}", code="body_too_large")

    async def read() -> bytearray:
        body = bytearray()  # grown in place: no second copy when the body is whole
        async for chunk in request.stream():
            if len(body) + len(chunk) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than {MAX_BODY_BYTES} bytes", code="body_too_large")
            body += chunk
        return body

    async with request.app.state.server.readers:
        try:
            return await asyncio.wait_for(read(), BODY_SECONDS)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body took more than {BODY_SECONDS:g} s to arrive",
                           code="body_timeout") from None


async def _parse(request: Request, model):
    raw = await _read_body(request)
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "not a field this server knows (nothing is silently ignored here); remove it"
        elif message.startswith("Value error, "):
            message = message[len("Value error, "):]
        raise ApiError(400, f"{field}: {message}", param=field) from None
    if (bad := body.unsupported()) is not None:
        raise ApiError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
    server = request.app.state.server
    if body.model != server.config.served_name:
        raise ApiError(404, f"model '{body.model}' is not served here; this server serves '{server.config.served_name}'",
                       param="model", code="model_not_found")
    return body


def _completion_ids(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = state.pipe.manifest.models["target"].vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return state.pipe.text.encode(text) if isinstance(text, str) and text else []


def _encode(state: ServerState, encode: Callable[[], list[int]], field: str) -> list[int]:
    try:
        ids = encode()
    except SpecexportError as err:  # a model without a chat template, a template's own error
        raise ApiError(400, f"{field}: {err}", param=field) from None
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty", param=field)
    return ids


async def _respond(request: Request, state: ServerState, engine: EngineThread, body, ids: list[int],
                   max_tokens: int | None, *, chat: bool):
    limit = state.pipe.max_seq_len
    if len(ids) >= limit:
        raise ApiError(413, f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                            "(prompt and completion together)", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - len(ids)
    elif len(ids) + max_tokens > limit:
        raise ApiError(400, f"max_tokens: {len(ids)} prompt tokens + {max_tokens} exceed this model's context of "
                            f"{limit}; ask for at most {limit - len(ids)}", param="max_tokens",
                       code="context_length_exceeded")
    controls = _controls(state, body)
    if controls.grammar is not None:  # compiled here, so a bad grammar is this request's 400
        try:
            await asyncio.to_thread(state.pipe.grammars.check, controls.grammar)
        except SpecexportError as err:
            raise ApiError(400, str(err), param=controls.grammar.field) from None
    params = Params(max_tokens, body.temperature, body.top_p, max(body.top_k, 0), body.seed, tuple(body.stops),
                    body.min_p, controls, *_speculation(state, body.speculation))
    job_id = engine.next_id("chatcmpl" if chat else "cmpl")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    # choice i samples with seed + i: n choices of one seeded request are n different draws
    jobs = [Job(job_id if i == 0 else f"{job_id}-{i}", ids,
                replace(params, seed=None if body.seed is None else body.seed + i), loop,
                stream=body.stream, events=events, index=i) for i in range(body.n)]
    if body.identity:
        _log.info("%s from %s", job_id, body.identity)
    try:
        engine.submit_all(jobs)
    except QueueFull as err:
        raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from None
    chunks = _Chunks(job_id, state.config.served_name, chat, body.return_token_ids, state.pipe.text.token_text,
                     controls.logprobs, state.config.spec_metrics)
    headers = {"x-served-by": _SERVED_BY}
    if body.stream:
        return StreamingResponse(_stream(engine, jobs, chunks, len(ids), body.include_usage, body.continuous_usage),
                                 media_type="text/event-stream", headers=headers)
    choices = [_Choice() for _ in jobs]
    while not all(c.done for c in choices):
        try:
            event: Event = await asyncio.wait_for(events.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                for job in jobs:
                    engine.cancel(job.id)
                return Response(status_code=499)
            continue
        if event.error is not None:
            for job in jobs:
                engine.cancel(job.id)
            raise ApiError(500, event.error, kind="server_error")
        choices[event.index].add(event)
    usage = _usage(len(ids), sum(len(c.tokens) for c in choices))
    return JSONResponse(chunks.whole(choices, usage), headers=headers)


def _speculation(state: ServerState, speculation) -> tuple[str | None, int | None]:
    """The request's drafter and depth cap from its ``speculation`` field (None: the server's),
    or a 400 naming the field: a drafter the server does not run, a depth past the engines' draft
    length."""
    if speculation is None:
        return None, None
    served = state.config.drafters
    if speculation.drafter not in (None, "none", *served):
        raise ApiError(400, f"speculation.drafter: this server drafts with {', '.join(served)} (or 'none' for the "
                            f"target alone), not '{speculation.drafter}'; start one with --drafter "
                            f"{','.join([*served, speculation.drafter])}", param="speculation.drafter")
    draft_len = state.pipe.manifest.draft_len
    if speculation.max_depth is not None and speculation.max_depth > draft_len:
        raise ApiError(400, f"speculation.max_depth: at most {draft_len}, the engines' draft length "
                            f"(got {speculation.max_depth})", param="speculation.max_depth")
    if speculation.drafter == "none" or served == ["none"]:
        return None, 0
    return speculation.drafter, speculation.max_depth


def _controls(state: ServerState, body) -> Controls:
    """The request's penalties, grammar and logprobs, or a 400 naming the field."""
    try:
        return body.controls(state.pipe.manifest.models["target"].vocab_size)
    except (ValueError, SpecexportError) as err:
        message = str(err)
        field = message.split(":", 1)[0] if ":" in message else None
        raise ApiError(400, message, param=field) from None


@dataclass
class _Choice:
    """One choice of a whole (not streamed) response, as its events arrive."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: str | None = None
    done: bool = False
    stats: DecodeStats | None = None

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        self.tokens += event.token_ids
        self.logprobs += event.logprobs
        if event.done:
            self.reason, self.done, self.stats = event.finish_reason, True, event.stats


async def _stream(engine: EngineThread, jobs: list[Job], chunks: _Chunks, prompt_tokens: int,
                  include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """Every choice's chunks as its rounds come in (choice i's carry index i)."""
    events = jobs[0].events
    running = set(range(len(jobs)))
    tokens = 0
    stats: list[DecodeStats] = []
    try:
        if chunks.chat:
            for job in jobs:
                yield _sse(chunks.piece(job.index, None, None, role=True))
        while running:
            event: Event = await events.get()
            if event.error is not None:
                yield _sse(ApiError(500, event.error, kind="server_error").body())
                break
            if event.done:
                running.discard(event.index)
                stats += [event.stats] if event.stats is not None else []
            tokens += len(event.token_ids)
            if event.text or event.token_ids or event.done:
                piece = chunks.piece(event.index, event.text, event.finish_reason if event.done else None,
                                     event.token_ids, event.logprobs)
                if continuous_usage:
                    piece["usage"] = _usage(prompt_tokens, tokens)
                if not running and not include_usage:  # the last chunk: the request's speculation stats
                    piece.update(chunks.metrics(stats))
                yield _sse(piece)
        if not running:
            if include_usage:
                yield _sse({**chunks.usage(_usage(prompt_tokens, tokens)), **chunks.metrics(stats)})
            yield "data: [DONE]\n\n"
    finally:
        for job in jobs:  # a choice still running: the client went away, free its slot at the next round
            if job.index in running:
                engine.cancel(job.id)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Chunks:
    """OpenAI's response and chunk bodies for one request (with vLLM's ``return_token_ids``
    extension: each choice also carries its token ids)."""

    def __init__(self, job_id: str, model: str, chat: bool, token_ids: bool, token_text: Callable[[int], str],
                 logprobs: int | None, spec_metrics: str | None = None):
        self.id, self.model, self.chat, self.token_ids = job_id, model, chat, token_ids
        self.token_text, self.logprobs, self.spec_metrics = token_text, logprobs, spec_metrics
        self.created = int(time.time())
        self._offset: dict[int, int] = {}  # choice -> characters of text before its next token (completions)

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def piece(self, index: int, text: str | None, reason: str | None, token_ids: list[int] | None = None,
              logprobs: list[TokenLogprob] | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(index, logprobs or [], role),
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._logprobs(index, logprobs or []),
                      "finish_reason": reason}
        if self.token_ids and not role:
            choice["token_ids"] = token_ids or []
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}

    def whole(self, choices: list[_Choice], usage: dict) -> dict:
        out = []
        for index, c in enumerate(choices):
            text = "".join(c.text)
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": self._logprobs(index, c.logprobs), "finish_reason": c.reason}
            else:
                choice = {"index": index, "text": text, "logprobs": self._logprobs(index, c.logprobs),
                          "finish_reason": c.reason}
            if self.token_ids:
                choice["token_ids"] = c.tokens
            out.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out, "usage": usage,
                **self.metrics([c.stats for c in choices if c.stats is not None])}

    def metrics(self, stats: list[DecodeStats]) -> dict:
        """vLLM's top-level ``metrics`` object with the request's speculation stats (summed over
        its choices), where the server was started with --per-request-spec-decode-metrics."""
        if self.spec_metrics is None:
            return {}
        return {"metrics": {"speculative_decoding": speculative_decoding(stats, self.spec_metrics == "detailed")}}

    def _logprobs(self, index: int, entries: list[TokenLogprob], role: bool = False) -> dict | None:
        """OpenAI's logprobs object for these tokens (None when the request did not ask)."""
        if self.logprobs is None or role:
            return None
        if self.chat:
            return {"content": [{**self._token(e.token, e.logprob),
                                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}
        texts = [self.token_text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self._offset.get(index, 0))
            self._offset[index] = offsets[-1] + len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
