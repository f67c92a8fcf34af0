"""Whether repeated timings are steady enough to write down as costs.

``specexport tune`` and ``plan --calibrate`` time every graph several rounds and keep the median.
On a busy machine the rounds of one graph scatter, and a median of scattered rounds misprices
the graphs against each other (adaptive depth then drafts where it should not). So before
writing, each timed entry's spread is checked: the middle half of its rounds (the
interquartile range) over their median. The middle half, not max - min: one round hit by a
preemption leaves the median alone and should not fail a run; and more rounds then help (one
outlier among many falls outside the middle half), which they could not with max - min, which
only grows with rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specexport.errors import SpecexportError

# The largest spread (interquartile range / median) written without --accept-noise: the cost
# differences the runtime decides by (a verify of 1+k tokens against a decode step) are tens of
# percent on CPU, so rounds scattered by a fifth of their median cannot rank them.
NOISE_LIMIT = 0.2

Rounds = Mapping[str, Sequence[float]]  # entry label -> seconds of each round
Samples = Mapping[str, Mapping[Hashable, Sequence[float]]]  # runner.time_rounds: name -> key -> rounds


def spread(seconds: Sequence[float]) -> float:
    """(q75 - q25) / median of one entry's rounds; 0 for fewer than two rounds."""
    if len(seconds) < 2:
        return 0.0
    q25, median, q75 = np.percentile(seconds, [25, 50, 75])
    return float((q75 - q25) / median) if median > 0 else 0.0


@dataclass(frozen=True)
class NoisyEntry:
    what: str  # the entry as the command names it, e.g. "target.verify.b1.t8"
    spread: float  # (q75 - q25) / median
    median_ms: float
    rounds: int

    def line(self) -> str:
        return (f"  {self.what}: spread {self.spread:.0%} of its median {self.median_ms:.3f} ms "
                f"over {self.rounds} rounds")


def noisy_entries(rounds: Rounds, limit: float = NOISE_LIMIT) -> list[NoisyEntry]:
    """The entries whose rounds spread more than ``limit``, noisiest first."""
    found = [NoisyEntry(what, spread(seconds), float(np.median(seconds)) * 1e3, len(seconds))
             for what, seconds in rounds.items() if spread(seconds) > limit]
    return sorted(found, key=lambda e: -e.spread)


def labelled(samples: Samples, label: Callable[[str, Hashable], str]) -> dict[str, Sequence[float]]:
    """runner.time_rounds' name -> key -> rounds as one label -> rounds (``label(name, key)``)."""
    return {label(name, key): seconds for name, by_key in samples.items() for key, seconds in by_key.items()}


def medians(samples: Samples) -> dict[str, dict[Hashable, float]]:
    """name -> key -> median seconds."""
    return {name: {key: float(np.median(s)) for key, s in by_key.items()} for name, by_key in samples.items()}


class NoisyTimings(SpecexportError):
    """Timings too scattered to write: the message is one line; ``entries`` says which and by how much.
    Its own exit code (3), so a script (the Makefile's ``engines``) can go on with the build's
    costs on a busy machine and still stop on any other failure."""

    exit_code = 3

    def __init__(self, entries: list[NoisyEntry], rounds: int, limit: float = NOISE_LIMIT):
        self.entries, self.limit = entries, limit
        super().__init__(
            f"{len(entries)} timed entries spread more than {limit:.0%} between rounds (worst "
            f"{entries[0].what}: {entries[0].spread:.0%}); nothing written: run on a quieter machine or with more "
            f"--rounds (now {rounds}), or pass --accept-noise to write them anyway")

    def report(self) -> str:
        """The noisy entries, one a line, for stderr before the error line."""
        return (f"noisy timings (interquartile range over median, limit {self.limit:.0%}):\n"
                + "\n".join(e.line() for e in self.entries))


def check_noise(rounds_of: Rounds, rounds: int, accept: bool, limit: float = NOISE_LIMIT) -> list[NoisyEntry]:
    """The noisy entries of ``rounds_of``; raises NoisyTimings when there are any and they are
    not ``accept``-ed."""
    entries = noisy_entries(rounds_of, limit)
    if entries and not accept:
        raise NoisyTimings(entries, rounds, limit)
    return entries
