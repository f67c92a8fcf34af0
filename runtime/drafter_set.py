"""Several drafters behind one loop: each request drafts with the one it chose.

A server started with ``--drafter ngram,eagle3`` runs one BatchLoop whose drafter is a
DrafterSet: every slot belongs to the member its request named (``Request.drafter``, default the
first), and the set routes each call of the Drafter protocol to that member alone. A member
keeps state only for the slots that are its own: it joins, hears what was accepted and moves a
row only for them, and a round asks it for drafts only for its rows (the others at depth 0, so
it leaves them alone). The speculation policy reads each row's member (``of``) for what is
particular to a drafter: its name (the acceptance estimate's tag), its round cost and its round
prices (runtime/policy.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specexport.runtime.drafters import DraftBudget, Drafter, DraftRow, PartCosts, TargetOut
from specexport.runtime.tree import DraftTree


class DrafterSet:
    """``members``: name -> a drafter over the loop's slots (the first is a request's default)."""

    def __init__(self, members: Mapping[str, Drafter], slots: int):
        if not members:
            raise ValueError("a drafter set needs at least one drafter")
        self.members = dict(members)
        self.default = next(iter(self.members))
        self.name = "+".join(self.members)
        # every member's outputs of the target, each asked once (a member reads only its own)
        self.needs: tuple[str, ...] = tuple(dict.fromkeys(n for m in self.members.values() for n in m.needs))
        self.builds_trees = all(m.builds_trees for m in self.members.values())
        # each member's own flags decide for its rows (SpeculationPolicy.drafter_of)
        self.drafts_free = self.drafts_long = False
        self._owner = [self.default] * slots  # slot -> the name of the member drafting for it

    def of(self, slot: int) -> Drafter:
        """The member drafting for ``slot``."""
        return self.members[self._owner[slot]]

    def assign(self, slot: int, name: str | None) -> None:
        """The request joining ``slot`` drafts with ``name`` (None: the default)."""
        name = self.default if name is None else name
        if name not in self.members:
            raise ValueError(f"drafter '{name}' is not one of this loop's ({', '.join(self.members)})")
        self._owner[slot] = name

    @property
    def engine_seconds(self) -> float:
        return sum(m.engine_seconds for m in self.members.values())

    def round_cost(self, k: int, costs: PartCosts | None = None) -> float:
        """The dearest member's (a round waits for every member's drafts)."""
        return max(m.round_cost(k, costs) for m in self.members.values())

    def catchup_cost(self, skipped: int) -> float:
        return max(m.catchup_cost(skipped) for m in self.members.values())

    def cost_graphs(self) -> dict[str, tuple[object, list[int]]]:
        return {f"{name}/{part}": graph for name, m in self.members.items() for part, graph in m.cost_graphs().items()}

    def join(self, slot: int, prompt: np.ndarray, target_out: TargetOut) -> None:
        member = self.of(slot)
        member.join(slot, prompt, {name: target_out[name] for name in member.needs})

    def prefill(self, slot: int) -> None:
        self.of(slot).prefill(slot)

    def propose(self, rows: Sequence[DraftRow], budget: DraftBudget) -> list[DraftTree]:
        owners = self._owner[: len(rows)]
        proposals: list[DraftTree | None] = [None] * len(rows)
        for name, member in self.members.items():
            mine = [r for r, owner in enumerate(owners) if owner == name]
            if not mine:
                continue
            depths = [d if owners[r] == name else 0 for r, d in enumerate(budget.depths)]  # [rows]
            drafted = member.propose(rows, DraftBudget(depths, budget.nodes, budget.top_k))
            for r in mine:
                proposals[r] = drafted[r]
        assert all(p is not None for p in proposals)
        return proposals  # type: ignore[return-value]

    def accept(self, slot: int, n_accepted: int, next_token: int, target_out: TargetOut) -> None:
        member = self.of(slot)
        member.accept(slot, n_accepted, next_token, {name: target_out[name] for name in member.needs})

    def leave(self, slot: int, context: np.ndarray, prompt_len: int) -> None:
        self.of(slot).leave(slot, context, prompt_len)

    def move(self, src: int, dst: int) -> None:
        self.of(src).move(src, dst)
        self._owner[dst] = self._owner[src]
