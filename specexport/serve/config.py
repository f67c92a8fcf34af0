"""What a server is started with. Plain data (it is pickled to each Ray Serve replica)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeConfig:
    engine_dir: str
    model_name: str = ""  # the name clients ask for; default: the engine directory's name
    drafter: str = "ngram"  # one the batched loop runs: none, ngram, the int4 copy, a draft model
    max_batch: int | None = None  # sequences per round (default: the largest batch size built)
    max_waiting: int = 64  # requests queued beyond the running ones; more get 429
    threads: int | None = None
    api_key: str | None = None  # clients send "Authorization: Bearer KEY"
    schedule: bool = True  # depth by batch size (the plan's draft.schedule)
    per_sequence: bool = False  # each round's width from the rows' own acceptance
    adaptive: bool = True  # each request's own adaptive depth under the schedule (as `generate`)

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.engine_dir).resolve().name
