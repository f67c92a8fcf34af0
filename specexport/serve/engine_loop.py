"""The engine thread: one BatchLoop (runtime/loop.py) stepping every request.

Request handlers (on the asyncio event loop) hand a Job to ``EngineThread.submit``; the thread
takes new jobs and cancellations between rounds, runs one round over every running sequence,
and posts each job's new text once per round to the job's asyncio queue
(``call_soon_threadsafe``: one wake-up per job per round, not per token). Admission is bounded:
at most max_batch running and max_waiting queued, beyond that ``submit`` raises QueueFull (429).
A client that goes away cancels its job; the BatchLoop frees its slot at the next round.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from specexport.runtime.logprobs import TokenLogprob
from specexport.runtime.loop import BatchLoop, Finished, RoundReport
from specexport.runtime.rules import Controls
from specexport.runtime.stats import DecodeStats
from specexport.serve.metrics import ServerMetrics
from specexport.serve.protocol import finish_reason

_log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


@dataclass
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    controls: Controls = field(default_factory=Controls)  # penalties, grammar, logprobs
    drafter: str | None = None  # which of the server's drafters drafts for it (None: the first)
    max_depth: int | None = None  # drafts a round at most (0: the target alone; None: the server's)


@dataclass
class Event:
    """What a job's handler receives: text released this round, and at the end the reason."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # tokens generated this round
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked for them
    index: int = 0  # the choice it belongs to (its job's index)
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    stats: DecodeStats | None = None  # at the end: what its decode counted


@dataclass
class Job:
    id: str
    prompt_ids: list[int]
    params: Params
    loop: asyncio.AbstractEventLoop  # the handler's event loop
    stream: bool = True  # False: one event at the end (no wake-up of the handler per round)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # the n jobs of one request share it
    index: int = 0  # which of the request's n choices

    arrived: float = field(default_factory=time.perf_counter)
    # engine thread only:
    tracker: object = None
    request: object = None  # the loop's Request (its logprobs fill as tokens are emitted)
    logprobs_sent: int = 0
    pending: list[int] = field(default_factory=list)  # this round's tokens, not yet posted
    held: list[int] = field(default_factory=list)  # a whole response's tokens, posted at the end
    first_at: float | None = None
    last_at: float | None = None

    def post(self, event: Event) -> None:
        event.index = self.index
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def new_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens emitted since the last call (none if not asked for)."""
        logprobs = getattr(self.request, "logprobs", None)
        if logprobs is None:
            return []
        entries = logprobs.entries[self.logprobs_sent :]
        self.logprobs_sent += len(entries)
        return entries


class EngineThread:
    def __init__(self, pipe, loop: BatchLoop, metrics: ServerMetrics, max_waiting: int):
        self.pipe, self.loop, self.metrics = pipe, loop, metrics
        self.capacity = loop.target.slots + max_waiting
        self.loop.on_token, self.loop.on_round = self._on_token, self._on_round
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit", Job) | ("cancel", id) | ("stop", None)
        self._jobs: dict[Hashable, Job] = {}  # engine thread only
        self._admitted = 0  # jobs submitted and not yet finished (guarded by _lock)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="specexport-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    def submit(self, job: Job) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue the jobs (a request's n choices: all or none), or raise QueueFull when
        max_batch + max_waiting would be exceeded."""
        with self._lock:
            if self._admitted + len(jobs) > self.capacity:
                raise QueueFull(f"the server has {self._admitted} requests running or waiting and room for "
                                f"{self.capacity}; retry later" + (" or ask for fewer choices" if len(jobs) > 1 else ""))
            self._admitted += len(jobs)
        self.metrics.prompt_tokens.inc(len(jobs[0].prompt_ids))  # one prefill serves them all
        for job in jobs:
            self._inbox.put(("submit", job))

    def cancel(self, job_id: str) -> None:
        self._inbox.put(("cancel", job_id))

    # --- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._take(block=not self.loop.busy):
                    break
                ended = self.loop.step()
            except Exception as err:  # noqa: BLE001 - a failing round must not kill the server silently
                _log.exception("engine round failed")
                self._fail_all(f"internal error in the engine: {type(err).__name__}: {err}")
                continue
            self._flush()
            for key, finished in ended:
                self._finish(key, finished)
            self.metrics.running.set(len(self.loop.running))
            self.metrics.waiting.set(len(self.loop.waiting))
        self._fail_all("the server is shutting down")
        while True:  # jobs that arrived too late to be taken
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._release(item, Event(done=True, error="the server is shutting down"))

    def _take(self, block: bool) -> bool:
        """New jobs and cancellations; blocks while idle. False: stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    continue
                return True
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(item)
            elif kind == "cancel" and item in self._jobs:
                self.loop.cancel(item)
            block = False  # take whatever else arrived, then run a round

    def _admit(self, job: Job) -> None:
        p = job.params
        try:
            request, job.tracker = self.pipe.batch_request(job.prompt_ids, max_new_tokens=p.max_tokens,
                                                           temperature=p.temperature, top_k=p.top_k,
                                                           top_p=p.top_p, min_p=p.min_p, seed=p.seed, stop=p.stop,
                                                           controls=p.controls, max_depth=p.max_depth,
                                                           drafter=p.drafter)
            job.request = request
        except Exception as err:  # noqa: BLE001 - checked before submit; a surprise fails only this job
            self._release(job, Event(done=True, error=str(err)))
            return
        self._jobs[job.id] = job
        self.loop.submit(job.id, request)

    def _on_token(self, key: Hashable, token: int) -> None:
        self._jobs[key].pending.append(token)

    def _on_round(self, report: RoundReport) -> None:
        self.metrics.round(report)

    def _flush(self) -> None:
        """Post each job's tokens of this round (its stop-safe text) once."""
        now = time.perf_counter()
        for job in self._jobs.values():
            if not job.pending:
                continue
            tokens, job.pending = job.pending, []
            n = len(tokens)
            self.metrics.generation_tokens.inc(n)
            if job.first_at is None:
                job.first_at = now
                self.metrics.ttft.observe(now - job.arrived)
                later = n - 1  # the round's other tokens came with the first
                gap = 0.0
            else:
                later, gap = n, (now - job.last_at) / n
            for _ in range(later):
                self.metrics.itl.observe(gap)
            job.last_at = now
            if job.stream:
                job.post(Event(text=job.tracker.ready(), token_ids=tokens, logprobs=job.new_logprobs()))
            else:
                job.held += tokens

    def _finish(self, key: Hashable, finished: Finished) -> None:
        job = self._jobs.pop(key)
        reason = finish_reason(finished.stats.stop_reason)
        if reason is not None:
            self.metrics.finished(reason)
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        else:  # cancelled: no one is left to answer
            self.metrics.cancelled.inc()
        self._release(job, Event(text=job.tracker.rest(), token_ids=job.held, logprobs=job.new_logprobs(),
                                 finish_reason=reason, done=True, stats=finished.stats))

    def _release(self, job: Job, event: Event) -> None:
        job.post(event)
        with self._lock:
            self._admitted -= 1

    def _fail_all(self, message: str) -> None:
        """Answer every job with an error and start over with an empty batch."""
        for job in list(self._jobs.values()):
            self._release(job, Event(done=True, error=message))
        for key in self._jobs:
            self.loop.cancel(key)
        self._jobs.clear()
        try:
            self.loop.step()  # drops the cancelled rows; nothing else is running
        except Exception:  # noqa: BLE001
            _log.exception("could not clear the batch")
