"""What each engine run costs, as the runners, the drafters and the adaptive depth read it:
measured on this machine by ``specexport tune`` where it was, else at build."""

from __future__ import annotations

from collections.abc import Callable

from specexport.contract import EngineEntry, Manifest, Role
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.costs import TunedCosts
from specexport.runtime.drafters import Drafter
from specexport.runtime.round_prices import RoundPrices
from specexport.runtime.runner import ModelRunner


class EngineCosts:
    def __init__(self, manifest: Manifest, tuned: TunedCosts | None, backend_of: Callable[[str], str],
                 check_prices: bool = True):
        """``backend_of``: model -> the backend its engines run on (Pipeline.backend_of);
        ``check_prices``: adaptive depth checks its prices against the clock."""
        self.manifest, self.tuned, self.backend_of = manifest, tuned, backend_of
        self.check_prices = check_prices
        # slots -> drafter -> its round prices as the clock checked them, kept across the loops
        # of the pipeline (SpeculationPolicy); fresh for every loop where prices are fixed
        self._prices: dict[int, dict[str, RoundPrices]] = {}

    def round_prices(self, slots: int) -> dict[str, RoundPrices] | None:
        """The round prices the loops over ``slots`` target slots share (None: each its own)."""
        return self._prices.setdefault(slots, {}) if self.check_prices else None

    def ms(self, entry: EngineEntry) -> float | None:
        """One run of the engine: measured on this machine by specexport tune, else at build."""
        tuned = self.tuned.ms(entry) if self.tuned is not None else None
        return tuned if tuned is not None else entry.cost_ms

    def by_role(self, model: str) -> dict[Role, dict[int, float]]:
        """role -> tokens -> ms of one batch-1 run of the model's graphs (0 where unmeasured)."""
        costs: dict[Role, dict[int, float]] = {}
        for entry in self.manifest.engines_of(model, self.backend_of(model)):
            costs.setdefault(entry.role, {})[entry.tokens] = self.ms(entry) or 0.0
        return costs

    @property
    def source(self) -> str:
        """Which costs are in use: "tuned (host, date)" or "build"."""
        return self.tuned.label if self.tuned is not None else "build"

    def depth_policy(self, drafter: Drafter, target: ModelRunner) -> DepthPolicy:
        """A fresh adaptive-depth policy: the target's verify costs and the drafter's own round
        cost. A verify of 1+k tokens is priced at what the target's runner runs for it (its
        decoding entries by the same costs, ModelRunner.verify_ms; past every verify entry the
        probe entry a long verify runs in), never at a larger entry than the one it picks."""

        def verify_cost(tokens: int) -> float | None:
            ms = target.verify_ms(tokens)
            return ms / 1e3 if ms else None

        return DepthPolicy(verify_cost, drafter.round_cost, drafter.catchup_cost, checked=self.check_prices,
                           one_token_rows=self.manifest.models["target"].one_token_rows)
