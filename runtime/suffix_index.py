"""A suffix trie over token documents, capped at ``depth`` tokens, with a count per node: the
index SuffixDecoding (Oliaro et al., 2024) drafts from, in pure Python.

Every suffix of every document is a path from the root, cut at ``depth`` tokens; a node counts
the suffixes that pass through it (how often its string occurs), so a node's children rank the
continuations of a match by frequency. A document grows one token at a time: each of its
``depth`` newest suffixes steps one node deeper, so an append costs O(depth) whatever the
document's length, and a lookup walks the pattern alone (no scan of the text). A path that only
one suffix takes below some node is not spelled out: that node's *tail* points at the rest in
the document's own tokens, and turns into nodes only when a second suffix comes the same way.
Unique text then costs about one node a token, not ``depth``.

Why not a maintained implementation: arctic-inference (SuffixDecoding's C++ tree) is not
installable here and pulls in torch with vLLM; nothing on PyPI offers a pure-Python one with
per-node counts and removal.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
_NONE = -1
_SHIFT = 32  # child key: parent << 32 | token (token ids are below 2**32)


@dataclass
class _Suffix:
    """One suffix of a growing document: where it starts, the deepest node it has reached
    (``node``) and its length (past ``node``'s depth: in that node's tail, its own)."""

    start: int
    node: int
    length: int


@dataclass(frozen=True)
class Match:
    """Where a pattern ends in the trie: at ``node``'s depth, or ``offset`` tokens into its tail."""

    node: int
    length: int  # the pattern's length (the match length)
    offset: int  # tokens past the node, in its tail (0: at the node)


class SuffixIndex:
    """Documents (token lists) indexed by every suffix, up to ``depth`` tokens each."""

    def __init__(self, depth: int):
        self.depth = depth
        self._child: dict[int, int] = {}  # parent << 32 | token -> child
        # per node, by id (0: the root); freed ids are reused
        self._count = array("q", [0])  # suffixes through the node
        self._token = array("q", [_NONE])
        self._parent = array("q", [_NONE])
        self._level = array("q", [0])  # its depth
        self._first = array("q", [_NONE])  # its first child (children: a sibling list, for ranking)
        self._next = array("q", [_NONE])  # its next sibling
        self._tail_doc = array("q", [_NONE])  # the one suffix continuing below it unspelled: its document
        self._tail_at = array("q", [0])  # and where in it that rest starts
        self._free: list[int] = []
        self.docs: dict[int, array] = {}  # document id -> its tokens
        self._active: dict[int, deque[_Suffix]] = {}  # an open document's suffixes shorter than depth
        self._ids = 0
        self._held = 0  # tokens in all documents (a counter: another thread may read it)

    # -- size ----------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return len(self._count) - 1 - len(self._free)

    @property
    def tokens(self) -> int:
        return self._held

    @property
    def nbytes(self) -> int:
        """An estimate of the memory held: the node arrays, the child map (about 100 bytes an
        entry: the dict slot and its key), the documents."""
        arrays = 8 * len(self._count) * 8
        return arrays + 100 * len(self._child) + 8 * self.tokens

    # -- documents ------------------------------------------------------------------------
    def open(self, tokens: Sequence[int] = ()) -> int:
        """A new document (its id), indexed with ``tokens``; ``extend`` appends to it."""
        doc = self._ids
        self._ids += 1
        self.docs[doc] = array("q")
        self._active[doc] = deque()
        self.extend(doc, tokens)
        return doc

    def extend(self, doc: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to an open document: O(depth) a token."""
        text, active = self.docs[doc], self._active[doc]
        for token in tokens:
            token = int(token)
            position = len(text)
            text.append(token)
            self._held += 1
            active.append(_Suffix(position, ROOT, 0))
            for suffix in active:
                self._step(doc, suffix, token, position)
            if active[0].length >= self.depth:
                active.popleft()

    def close(self, doc: int) -> None:
        """No more tokens for ``doc``: its suffixes stay indexed as they are."""
        self._active.pop(doc, None)

    def remove(self, doc: int) -> None:
        """Take every suffix of ``doc`` out of the trie (its counts down, nodes nobody passes freed)."""
        self.close(doc)
        text = self.docs[doc]
        for start in range(len(text)):
            node, end = ROOT, min(start + self.depth, len(text))
            for i in range(start, end):
                if self._tail_doc[node] == doc and self._tail_at[node] == i:
                    self._tail_doc[node] = _NONE  # the rest was this suffix's own tail
                    break
                child = self._child[node << _SHIFT | text[i]]
                self._count[child] -= 1
                if self._count[child] == 0:
                    self._drop(child)
                    break
                node = child
            else:
                if self._tail_doc[node] == doc and self._tail_at[node] == end:
                    self._tail_doc[node] = _NONE
        del self.docs[doc]
        self._held -= len(text)

    # -- lookup ---------------------------------------------------------------------------
    def find(self, pattern: Sequence[int]) -> Match | None:
        """Where ``pattern`` (at most ``depth`` tokens) ends, None where no suffix begins with it."""
        node, i, n = ROOT, 0, len(pattern)
        while i < n:
            child = self._child.get(node << _SHIFT | pattern[i], _NONE)
            if child == _NONE:
                tail = self._tail(node)
                if tail is None or len(tail) < n - i or list(tail[: n - i]) != list(pattern[i:]):
                    return None
                return Match(node, n, n - i)
            node, i = child, i + 1
        return Match(node, n, 0)

    def longest(self, context: Sequence[int], longest: int) -> Match | None:
        """The longest suffix of ``context`` (at most ``longest`` tokens) the trie holds with a
        token after it: tried longest first, each a walk of its own length."""
        for n in range(min(longest, len(context), self.depth - 1), 0, -1):
            found = self.find(context[len(context) - n :])
            if found is not None and self._has_next(found):
                return found
        return None

    def continuations(self, match: Match, depth: int, nodes: int, top_k: int,
                      min_prob: float) -> tuple[list[int], list[int], list[float]]:
        """A draft tree after ``match``: (tokens, parents, path probabilities), parents first.
        Best first by path probability (a child's share of the counts continuing past its
        parent, times its parent's), at most ``top_k`` children a node, ``depth`` levels and
        ``nodes`` nodes, none below ``min_prob``. A chain: ``top_k`` = 1."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, Match]] = []  # (-prob, order, parent index, where)
        order = 0
        for prob, where in self._next_steps(match, top_k):
            heap.append((-prob, order, _NONE, where))
            order += 1
        heapq.heapify(heap)
        while heap and len(tokens) < nodes:
            neg, _, parent, where = heapq.heappop(heap)
            if -neg < min_prob:
                break
            index = len(tokens)
            tokens.append(self._token_at(where))
            parents.append(parent)
            probs.append(-neg)
            if where.length - match.length < depth:
                for prob, below in self._next_steps(where, top_k):
                    heapq.heappush(heap, (neg * prob, order, index, below))
                    order += 1
        return tokens, parents, probs

    def follow(self, match: Match) -> tuple[int, float, Match] | None:
        """The most frequent token after ``match``: (the token, its share of what continues past
        ``match``, the match one token longer); None where nothing follows. O(children)."""
        steps = self._next_steps(match, 1)
        if not steps:
            return None
        share, where = steps[0]
        return self._token_at(where), share, where

    # -- internals ------------------------------------------------------------------------
    def _tail(self, node: int) -> array | None:
        """The unspelled rest below ``node`` (one suffix's), within the depth cap; None: none."""
        doc = self._tail_doc[node]
        if doc == _NONE:
            return None
        at = self._tail_at[node]
        return self.docs[doc][at : at + self.depth - self._level[node]]

    def _has_next(self, match: Match) -> bool:
        if match.offset:
            tail = self._tail(match.node)
            return tail is not None and len(tail) > match.offset
        return self._first[match.node] != _NONE or bool(self._tail(match.node))

    def _token_at(self, where: Match) -> int:
        """The token that ends at ``where`` (a node's own, or one in its parent node's tail)."""
        if not where.offset:
            return self._token[where.node]
        return self.docs[self._tail_doc[where.node]][self._tail_at[where.node] + where.offset - 1]

    def _next_steps(self, where: Match, top_k: int) -> list[tuple[float, Match]]:
        """The places one token further, up to ``top_k`` most frequent, with their shares."""
        node = where.node
        tail = self._tail(node)
        if where.offset or tail:
            offset = where.offset
            return [(1.0, Match(node, where.length + 1, offset + 1))] if tail is not None and len(tail) > offset else []
        kids = []
        child = self._first[node]
        while child != _NONE:
            kids.append((self._count[child], child))
            child = self._next[child]
        if not kids:
            return []
        total = sum(c for c, _ in kids)
        if top_k == 1:  # a chain's step: the most frequent alone (max keeps the earlier sibling on a tie)
            count, child = max(kids, key=lambda kid: kid[0])
            return [(count / total, Match(child, where.length + 1, 0))]
        kids.sort(key=lambda kid: -kid[0])  # stable: earlier siblings first on a tie
        return [(c / total, Match(child, where.length + 1, 0)) for c, child in kids[:top_k]]

    def _step(self, doc: int, suffix: _Suffix, token: int, position: int) -> None:
        """``suffix`` of ``doc`` grows by ``token`` (at ``position``)."""
        node = suffix.node
        while suffix.length > self._level[node] and not self._owns(node, doc, suffix):
            # its tail was spelled out by a suffix that came the same way since: follow the nodes
            node = self._child[node << _SHIFT | self.docs[doc][suffix.start + self._level[node]]]
        suffix.node = node
        if suffix.length > self._level[node] or self._owns(node, doc, suffix):
            suffix.length += 1  # in its own tail (a node with a tail has no children): nothing to spell
            return
        self._spell(node)  # another suffix's tail: its first token becomes a node this one may share
        key = node << _SHIFT | token
        child = self._child.get(key, _NONE)
        if child == _NONE:
            child = self._new(node, token)
            self._tail_doc[child], self._tail_at[child] = doc, position + 1
        else:
            self._count[child] += 1
        suffix.node, suffix.length = child, suffix.length + 1

    def _owns(self, node: int, doc: int, suffix: _Suffix) -> bool:
        return self._tail_doc[node] == doc and self._tail_at[node] == suffix.start + self._level[node]

    def _spell(self, node: int) -> None:
        """Turn the first token of ``node``'s tail into a child node (which takes the rest)."""
        tail = self._tail(node)
        doc, at = self._tail_doc[node], self._tail_at[node]
        self._tail_doc[node] = _NONE
        if tail:
            child = self._new(node, tail[0])
            self._tail_doc[child], self._tail_at[child] = doc, at + 1

    def _new(self, parent: int, token: int) -> int:
        values = (1, token, parent, self._level[parent] + 1, _NONE, self._first[parent], _NONE, 0)
        columns = (self._count, self._token, self._parent, self._level, self._first, self._next,
                   self._tail_doc, self._tail_at)
        if self._free:
            node = self._free.pop()
            for column, value in zip(columns, values):
                column[node] = value
        else:
            node = len(self._count)
            for column, value in zip(columns, values):
                column.append(value)
        self._first[parent] = node
        self._child[parent << _SHIFT | token] = node
        return node

    def _drop(self, node: int) -> None:
        """Unlink ``node`` from its parent and free it with everything below."""
        parent = self._parent[node]
        del self._child[parent << _SHIFT | self._token[node]]
        if self._first[parent] == node:
            self._first[parent] = self._next[node]
        else:
            sibling = self._first[parent]
            while self._next[sibling] != node:
                sibling = self._next[sibling]
            self._next[sibling] = self._next[node]
        stack = [node]
        while stack:
            n = stack.pop()
            child = self._first[n]
            while child != _NONE:
                del self._child[n << _SHIFT | self._token[child]]
                stack.append(child)
                child = self._next[child]
            self._tail_doc[n], self._first[n], self._count[n] = _NONE, _NONE, 0
            self._free.append(n)
