"""Token trees: several guesses per position, verified in one pass, pure numpy.

A ``DraftTree`` holds N draft nodes in topological order; node i follows ``parents[i]`` (−1: the
root, the last committed token, which the verify pass also feeds). The verify pass runs 1+N
rows: row 0 is the root, row 1+i node i, each at position cache_length + depth and attending
to its ancestors only (``verify_inputs``). Its rows give the target's choice after every node,
so acceptance (runtime/acceptance.py) walks down from the root:

- ``tree_greedy``: follow the child whose token is the target's argmax; the argmax after the
  last node followed comes next. The output is exactly target-only greedy decoding, as for a
  chain (a chain is a tree whose nodes each have one child).
- ``tree_rejection``: the deterministic-draft rule for drafts chosen without sampling (top-k
  children, n-gram continuations). At a node with children x_1..x_m (distinct tokens) and the
  target's warped p: accept x_1 with probability p(x_1); if rejected, p becomes p with x_1
  removed, renormalised, and x_2 is tried under it; and so on. If every child is rejected, the
  next token is drawn from what is left of p. Each step is rejection sampling against a point
  mass (accept with min(1, p(x)/1), else draw from norm(max(0, p − δ_x))), so every emitted
  token is distributed exactly as p, whatever children were proposed. Why this rule and not
  SpecInfer's multi-draft rule over q: tree drafters pick their children deterministically
  (the highest joint draft probability, EAGLE-2's expansion), so there is no q they were drawn
  from, and SpecInfer's rule needs children drawn i.i.d. from q.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specexport.runtime.acceptance import Draft, Kept

ROOT = -1

# How many of a tree's best nodes the decode loop would verify (adaptive tree size,
# runtime/tree_size.py), given their weights and depths [n], best first, and the levels already
# drafted (a deeper node costs the drafter more steps): a drafter growing a tree level by level
# stops where no deeper node could be among them.
SizeHint = Callable[[np.ndarray, np.ndarray, int], int]


@cache
def chain_parents(n: int) -> np.ndarray:
    """[n] a chain's parents, -1, 0, 1, ..., n-2: one read-only array per length, shared by every
    chain of that length (a round's proposals are made without allocating or checking them)."""
    parents = np.arange(-1, n - 1, dtype=np.int64)
    parents.flags.writeable = False
    return parents


@dataclass(frozen=True)
class DraftTree:
    """A round's proposal for one sequence, where drafting meets verifying. A chain (each node
    the only child of the one before) is a tree too: ``chain`` makes one from a ``Draft``."""

    tokens: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int64, parents[i] < i (−1: the root)
    tag: str = ""  # what kind of guess this is (as Draft.tag)
    # [N] the drafter's estimate that node i ends up on the accepted path (its joint draft
    # probability; n-gram: the share of matches through it); None: no estimate
    weights: np.ndarray | None = None
    # a sampled chain: [N] the distribution q each token was drawn from (rejection sampling
    # reads it); None: point masses (drafts chosen, not drawn)
    probs: Sequence[Kept] | np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        if self.parents is chain_parents(len(self.parents)) and self.weights is None:
            return  # a chain (every round of a chain drafter makes one): nothing to check
        if self.weights is not None and len(self.weights) != len(self.tokens):
            raise ValueError("a tree needs one weight per token")
        parents = np.asarray(self.parents)  # [N]
        if ((parents < ROOT) | (parents >= np.arange(len(parents)))).any():
            raise ValueError("parents must come before their children (topological order)")

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens, tag: str = "", probs: Sequence[Kept] | np.ndarray | None = None) -> DraftTree:
        tokens = np.asarray(tokens, dtype=np.int64)
        return cls(tokens, chain_parents(len(tokens)), tag, probs=probs)

    @classmethod
    def of_draft(cls, draft: Draft) -> DraftTree:
        """A chain drafter's proposal as a tree."""
        return cls.chain(draft.tokens, draft.tag, draft.probs)

    @cached_property
    def is_chain(self) -> bool:
        """Each node the only child of the one before: acceptance reads it left to right."""
        return self.parents is chain_parents(self.size) or bool((self.parents == chain_parents(self.size)).all())

    def path_rows(self, path: list[int]) -> slice | list[int]:
        """The verify rows of the root and the accepted ``path`` (row 0 the root, 1+i node i):
        a slice for a chain, whose path is its first nodes."""
        return slice(0, 1 + len(path)) if self.is_chain else [0, *(1 + p for p in path)]

    @property
    def depth(self) -> int:
        """The deepest node's depth (0: no nodes)."""
        return self.size if self.is_chain else int(self.depths().max()) if self.size else 0

    def depths(self) -> np.ndarray:
        """[N] each node's distance from the root (its children: 1)."""
        depth = np.zeros(self.size, dtype=np.int64)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent == ROOT else depth[parent] + 1
        return depth

    def children(self, node: int) -> list[int]:
        """The nodes under ``node`` (ROOT: the first level), in order."""
        return np.flatnonzero(self.parents == node).tolist()

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` ([] for ROOT)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = int(self.parents[node])
        return nodes[::-1]

    def subset(self, keep: list[int]) -> DraftTree:
        """The nodes ``keep`` (increasing; each one's parent kept or the root), renumbered."""
        index = {ROOT: ROOT, **{node: i for i, node in enumerate(keep)}}
        return DraftTree(self.tokens[keep], np.array([index[int(self.parents[n])] for n in keep], dtype=np.int64),
                         self.tag, None if self.weights is None else self.weights[keep],
                         None if self.probs is None else [self.probs[n] for n in keep])

    def prefix(self, keep: int) -> DraftTree:
        """A chain's first ``keep`` nodes (a prefix of a chain is a chain)."""
        if keep >= self.size:
            return self
        parents = chain_parents(keep) if self.is_chain else self.parents[:keep]
        return DraftTree(self.tokens[:keep], parents, self.tag,
                         None if self.weights is None else self.weights[:keep],
                         None if self.probs is None else self.probs[:keep])

    def capped_weights(self) -> np.ndarray:
        """[N] each node's weight, capped by its parent's (a node is on the accepted path only
        if its parent is, whatever the drafter said); ones without weights."""
        if self.weights is None:
            return np.ones(self.size)
        weight = np.array(self.weights, dtype=np.float64)  # [N]
        for i, parent in enumerate(self.parents.tolist()):
            if parent != ROOT:
                weight[i] = min(weight[i], weight[parent])
        return weight

    def ranked(self) -> np.ndarray:
        """[N] the nodes, best first by capped weight, every parent before its children: the
        first n of them are the best tree of n nodes. Without weights, the topological order."""
        return np.lexsort((np.arange(self.size), -self.capped_weights()))  # ties: the earlier node

    def best(self, n: int) -> DraftTree:
        """The ``n`` nodes ranked first (``ranked``), as a tree."""
        return self if n >= self.size else self.subset(sorted(self.ranked()[:n].tolist()))

    def verify_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """The verify pass's tree inputs for root + nodes: depth offsets [1+N] (row 0, the
        root: 0) and the ancestor mask [1+N, 1+N] (row r sees row c when c is r or above it)."""
        n = self.size
        offsets = np.concatenate(([0], self.depths()))  # [1+N]
        mask = np.zeros((n + 1, n + 1), dtype=bool)  # [1+N, 1+N]
        mask[:, 0] = True
        for i, parent in enumerate(self.parents.tolist()):
            mask[i + 1] = mask[parent + 1]
            mask[i + 1, i + 1] = True
        return offsets, mask


def spine_joint(top_logprobs: np.ndarray) -> np.ndarray:
    """[d, k] every candidate's log joint draft probability over a chain's levels (``top_logprobs``
    [d, k], column 0 the spine): the spine's log q down to the level above, plus its own."""
    above = np.concatenate(([0.0], np.cumsum(top_logprobs[:-1, 0])))  # [d] log joint of the spine above each level
    return above[:, None] + top_logprobs


def spine_tree(top_tokens: np.ndarray, top_logprobs: np.ndarray, nodes: int, tag: str = "") -> DraftTree:
    """EAGLE-2's selection over a drafted chain: level j's top-k tokens after the chain's first j
    (``top_tokens`` / ``top_logprobs`` [d, k], best first; column 0 is the chain, the spine)
    are candidates under the spine node above; a candidate's weight is its joint draft
    probability (the spine's probabilities down to it, times its own), and the ``nodes`` of
    highest weight are kept. Only the spine is expanded further: a sibling is a leaf, so the
    drafter runs one step per level, as for a chain."""
    depth, k = top_tokens.shape
    joint = spine_joint(top_logprobs)  # [d, k]
    order = np.lexsort((np.tile(np.arange(k), depth), np.repeat(np.arange(depth), k), -joint.ravel()))
    chosen = sorted(order[:nodes].tolist())  # level-major: every spine node before the level under it
    index: dict[int, int] = {}  # chosen spine level -> its node
    tokens, parents, weights = [], [], []
    for flat in chosen:
        level, rank = divmod(flat, k)
        if level > 0 and level - 1 not in index:
            continue  # its spine parent was not kept (a tie); it cannot hang anywhere
        if rank == 0:
            index[level] = len(tokens)
        tokens.append(int(top_tokens[level, rank]))
        parents.append(index[level - 1] if level > 0 else ROOT)
        weights.append(float(np.exp(joint[level, rank])))
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), tag,
                     np.array(weights, dtype=np.float64))


def expansion_budget(nodes: int, hint: SizeHint | None, weights: np.ndarray, depths: np.ndarray, under: int,
                     levels: int = 1) -> int:
    """How many nodes a descendant of candidate ``under`` would have to rank among to be
    verified (candidates' ``weights`` and ``depths`` [N], each weight at most its parent's):
    ``nodes``, or fewer where the loop would verify fewer of these candidates plus a path of
    ``levels`` more nodes below ``under`` (``hint``). The path's nodes are given ``under``'s
    weight, the most a descendant can weigh (joint probability only falls with depth), so a level
    the hint turns away holds no node the loop would have verified."""
    if hint is None:
        return nodes
    drafted = int(depths.max())
    weights = np.append(weights, np.full(levels, weights[under]))  # [N+levels]
    depths = np.append(depths, depths[under] + np.arange(1, levels + 1))  # [N+levels]
    ranked = np.lexsort((np.arange(len(weights)), -weights))[:nodes]  # ties: the earlier (a parent first)
    return min(nodes, hint(weights[ranked], depths[ranked], drafted))


class Spine:
    """``spine_tree`` over a chain being drafted, one level at a time: ``add`` takes a level's
    logits and returns the spine token to step next, or None once the chain stops: at ``depth``
    levels, or once no deeper node can make the cut (``nodes`` candidates already weigh at least
    the deepest spine node, and joint probability only falls along the spine; with a ``hint``,
    the nodes the loop would verify, ``expansion_budget``). ``top`` picks a level's candidates
    (default ``top_candidates``)."""

    def __init__(self, depth: int, nodes: int, top_k: int,
                 top: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None,
                 hint: SizeHint | None = None):
        self.depth, self.nodes, self.top_k, self.hint = depth, nodes, top_k, hint
        self._top = top or top_candidates
        self._tops: list[np.ndarray] = []  # per level: [k] tokens
        self._logps: list[np.ndarray] = []  # per level: [k] log q

    def add(self, logits: np.ndarray) -> int | None:
        """The next level's logits [V]: its candidates join; the spine token to step, or None."""
        tokens, logp = self._top(logits, self.top_k)
        self._tops.append(tokens)
        self._logps.append(logp)
        if len(self._tops) == self.depth:
            return None
        joint = spine_joint(np.stack(self._logps))  # [levels, k]
        heavier = int((joint >= joint[-1, 0]).sum())  # candidates at least as heavy as the deepest spine node
        if heavier >= self.nodes or heavier >= self._budget(joint):
            return None
        return int(tokens[0])

    def _budget(self, joint: np.ndarray) -> int:
        """``expansion_budget`` below the deepest spine node (``joint`` [levels, k] level-major:
        level j's candidates at j * k, its spine node first)."""
        if self.hint is None:
            return self.nodes
        levels, k = joint.shape
        depths = np.repeat(np.arange(1, levels + 1), k)  # [levels * k]
        return expansion_budget(self.nodes, self.hint, np.exp(joint).ravel(), depths, (levels - 1) * k,
                                self.depth - levels)

    def tree(self, tag: str = "") -> DraftTree:
        return spine_tree(np.stack(self._tops), np.stack(self._logps), self.nodes, tag)


def grow_spine(next_logits: Callable[[int | None], np.ndarray], depth: int, nodes: int, top_k: int,
               tag: str = "", top: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None,
               hint: SizeHint | None = None) -> DraftTree:
    """``Spine`` over a chain drafted here: ``next_logits(None)`` gives level 1's logits,
    ``next_logits(token)`` the next level's after the spine's ``token``."""
    spine = Spine(depth, nodes, top_k, top, hint)
    token = spine.add(next_logits(None))
    while token is not None:
        token = spine.add(next_logits(token))
    return spine.tree(tag)


def top_candidates(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A drafter's ``k`` best tokens after one position and their log-probabilities, best first
    (logits [V]; -inf outside a head's draft vocabulary). Logits [n, V] give each row's, [n, k]."""
    rows = np.atleast_2d(logits)  # [n, V]
    index = np.arange(len(rows))[:, None]  # [n, 1]
    top = np.argpartition(-rows, k - 1, axis=1)[:, :k]  # [n, k]
    top = top[index, np.argsort(-rows[index, top], axis=1, kind="stable")]  # [n, k] best first
    picked = rows[index, top]  # [n, k]
    peak = picked[:, :1]  # [n, 1]
    log_norm = peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))  # [n, 1]
    tokens, logp = top.astype(np.int64), (picked - log_norm).astype(np.float64)
    return (tokens, logp) if logits.ndim == 2 else (tokens[0], logp[0])
