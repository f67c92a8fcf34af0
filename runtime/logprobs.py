"""Log probabilities of emitted tokens, as OpenAI's API reports them.

They are the target's raw distribution at each emitted token: log-softmax of its logits
before any rule (penalties, bias, grammar) or warp (temperature, top-k/p, min-p), which is
what vLLM reports by default (``logprobs_mode: raw_logprobs``). They are read from the same
verify pass that accepted the token, so a token has the same logprobs with or without
speculation, to the float rounding between verify widths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens, best first (ties by id): (id, logprob)


@dataclass
class Logprobs:
    """What a request asked for (``top`` alternatives per token, 0..20) and what it got."""

    top: int = 0
    entries: list[TokenLogprob] = field(default_factory=list)

    def add(self, logits: np.ndarray, token: int) -> None:
        """One emitted token and the logits [V] it was chosen from."""
        z = logits.astype(np.float64)  # [V]
        top = float(z.max())
        log_total = top + float(np.log(np.exp(z - top).sum()))
        best: tuple[tuple[int, float], ...] = ()
        if self.top:
            ids = np.argpartition(-z, self.top - 1)[: self.top]  # [k] unordered
            ids = ids[np.lexsort((ids, -z[ids]))]  # best first, ties by id
            best = tuple((int(i), float(z[i] - log_total)) for i in ids)
        self.entries.append(TokenLogprob(int(token), float(z[token] - log_total), best))
