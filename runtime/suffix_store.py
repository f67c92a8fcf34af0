"""The store of earlier responses a suffix drafter drafts from beside the request's own context
(runtime/suffix_drafter.py): one suffix index over every response a pipeline has finished,
bounded by a token budget, the oldest response evicted first. One per pipeline and drafter
name, so it spans a batch (generate_batch, generate --prompts-file) and a server's requests."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specexport.runtime.suffix_index import SuffixIndex


class ResponseStore:
    """Responses (token lists) in one SuffixIndex, at most ``budget`` tokens in all (0: off)."""

    def __init__(self, budget: int, depth: int):
        self.budget = budget
        self.index = SuffixIndex(depth)
        self._docs: deque[tuple[int, int]] = deque()  # (document, tokens), oldest first
        self.tokens = 0  # tokens held (a counter: /metrics reads it from another thread)
        self.added = 0  # responses stored
        self.evicted = 0  # responses evicted for the budget
        self.lookups = 0  # rounds that looked in the store
        self.hits = 0  # rounds whose draft came from it (a chain: took a token from it)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def responses(self) -> int:
        return len(self._docs)

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def add(self, tokens: Sequence[int]) -> None:
        """Store a response (its last ``budget`` tokens at most), evicting the oldest ones until
        the store is within its budget again. O(index depth) a token."""
        if not self.enabled or not len(tokens):
            return
        kept = [int(t) for t in tokens[-self.budget :]]
        doc = self.index.open(kept)
        self.index.close(doc)
        self._docs.append((doc, len(kept)))
        self.tokens += len(kept)
        self.added += 1
        while self.tokens > self.budget:
            old, size = self._docs.popleft()
            self.index.remove(old)
            self.tokens -= size
            self.evicted += 1

    def clear(self) -> None:
        """Forget every response (a bench pass starts from an empty store)."""
        self.index = SuffixIndex(self.index.depth)
        self._docs.clear()
        self.tokens = self.added = self.evicted = self.lookups = self.hits = 0

    def stats(self) -> dict[str, float]:
        """What /metrics and the bench report."""
        return {"tokens": self.tokens, "responses": self.responses, "bytes": self.nbytes, "nodes": self.index.nodes,
                "lookups": self.lookups, "hits": self.hits, "evicted": self.evicted,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0}
