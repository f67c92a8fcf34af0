"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit, for every
running sequence at once. A lone request (``generate``) is a batch of one.

Each running sequence owns a slot, a row of the target's cache, and its own state: committed
tokens, position, sampling, stops, stats, adaptive depth. Cache invariant: a row's cache holds
every committed token but the last one. A round feeds each row [last, d1..dk] (right-padded to
the longest; one row runs alone), so the target's outputs at those 1+k positions give its choice
after each prefix; the accepted drafts and the next token are committed, and the row's cache
length moves back past the rejected drafts (a rewind is a length). Sequences join free slots
between rounds (each prefilled alone, at batch 1, into its row) and leave when done; running
rows stay at the front of the cache, so a round runs the smallest built batch that holds them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from specexport.contract import LOGITS, NEXT_TOKENS, DraftSchedule
from specexport.runtime.acceptance import Draft, Sampling, Warped, greedy, rejection, warp_row
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafters import Drafter, DraftRow, TreeDrafter
from specexport.runtime.goodput import best_width, observed
from specexport.runtime.logprobs import Logprobs
from specexport.runtime.model import Model
from specexport.runtime.rules import RuledRows, SequenceRules, greedy_walk
from specexport.runtime.stats import DecodeStats
from specexport.runtime.tree import DraftTree, SizeHint, tree_greedy, tree_rejection
from specexport.runtime.tree_size import TreeSizer, shared_size
from specexport.runtime.tree_verify import TreeVerifier


@dataclass
class Request:
    prompt: np.ndarray  # [n] int64, n >= 1
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    stop: Callable[[int], bool] | None = None  # sees each token; True ends the sequence after it
    rules: SequenceRules | None = None  # penalties, biases, grammar: applied to every row the target scores
    logprobs: Logprobs | None = None  # filled with each emitted token's log probabilities

    @property
    def needs_logits(self) -> bool:
        """Its rows are chosen from logits, not the graph's argmax."""
        return not self.sampling.greedy or self.rules is not None or self.logprobs is not None


@dataclass
class Finished:
    tokens: list[int]
    stats: DecodeStats


@dataclass
class _Running:
    key: Hashable  # the request's key: its position in decode_batch's list, the server's request id
    request: Request
    context: np.ndarray  # [S_max + 1] committed tokens: prompt + output
    length: int  # committed tokens; the cache holds length - 1 of them
    stats: DecodeStats
    policy: DepthPolicy | None = None  # this sequence's own adaptive depth
    tree_sizer: TreeSizer | None = None  # with it, its adaptive tree size


@dataclass
class RoundReport:
    """What one round ran: for metrics (the server's batch size, depth and acceptance counters)."""

    rows: int  # running sequences
    batch: int  # the built batch size that ran them
    width: int  # verify tokens per row (1 + the deepest draft)
    depth: int  # the depth the schedule allowed this round
    proposed: list[int]  # [rows] draft tokens offered, per row, as counted by DecodeStats
    accepted: list[int]  # [rows] of them kept
    verify_s: float


class BatchLoop:
    """Continuous batching over the target's slots: requests are submitted under a key at any
    time, join free slots between rounds (prefilled alone, at batch 1, into their row), and
    leave when done or cancelled. ``step()`` runs one round; the caller decides when (a batch
    call loops until idle, the server's engine thread forever). Not thread-safe: one thread
    owns it."""

    def __init__(self, target: Model, drafter: Drafter, *, draft_len: int, eos_ids: frozenset[int],
                 on_token: Callable[[Hashable, int], None] | None = None, schedule: DraftSchedule | None = None,
                 per_sequence: bool = False, on_round: Callable[[RoundReport], None] | None = None,
                 adaptive: Callable[[], DepthPolicy] | None = None, tree: TreeVerifier | None = None,
                 tree_nodes: int = 0, tree_top_k: int = 4):
        if per_sequence and not target.costs:
            target.measure_costs()
        self.target, self.draft_len, self.eos_ids = target, draft_len, eos_ids
        self.drafter = drafter
        self.on_token, self.on_round = on_token, on_round
        self.schedule = schedule  # caps the depth; per_sequence then picks the width under it
        self.widths = _Widths(DepthPolicy(lambda tokens: None)) if per_sequence else None
        # Each sequence's own adaptive depth under the cap: a request alone in the batch decodes
        # as `generate` does (the same depths, so the same draws when sampled). per_sequence
        # replaces it.
        self.adaptive = None if per_sequence else adaptive
        # token trees: each row verifies a tree of up to tree_nodes drafts (at B > 1 at most the
        # schedule's depth) when the drafter builds them (a TreeDrafter) and the batch size has
        # a tree graph; otherwise chains
        self.tree = tree if tree_nodes > 0 and isinstance(drafter, TreeDrafter) else None
        self.tree_nodes, self.tree_top_k = tree_nodes, tree_top_k
        self.waiting: deque[tuple[Hashable, Request]] = deque()
        self.running: list[_Running] = []
        self._cancelled: set[Hashable] = set()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> Iterator[list[tuple[Hashable, Finished]]]:
        """Step until nothing is waiting or running: each step's ended requests (often none)."""
        while self.busy:
            yield self.step()

    def submit(self, key: Hashable, request: Request) -> None:
        self.waiting.append((key, request))

    def cancel(self, key: Hashable) -> None:
        """Stop the request at the next step (waiting: dropped; running: finished, stop
        reason "cancelled", its slot freed)."""
        self._cancelled.add(key)

    def step(self) -> list[tuple[Hashable, Finished]]:
        """Join, one round over every running sequence, leave: the requests that ended."""
        ended = self._drop_cancelled()
        last: _Prefill | None = None  # this step's last prefill: a request with the same prompt copies it (n > 1)
        while self.waiting and len(self.running) < self.target.slots:  # join: prefill alone, into the next slot
            key, request = self.waiting.popleft()
            shared = last if last is not None and np.array_equal(last.prompt, request.prompt) else None
            seq, last = _start(self.target, self.drafter, len(self.running), key, request, self.draft_len, shared)
            self.running.append(seq)
            if self.adaptive is not None:
                self.running[-1].policy = self.adaptive()
        if self.running:
            depth = self.draft_len if self.schedule is None else min(self.draft_len, self.schedule.depth(len(self.running)))
            report = None
            if self.tree is not None:
                report = _tree_round(self.target, self.drafter, self.tree, self.running, depth,
                                     self.tree_nodes, self.tree_top_k, self.eos_ids, self.on_token)
            if report is None:
                report = _round(self.target, self.drafter, self.running, depth, self.eos_ids, self.on_token,
                                self.widths)
            if self.on_round is not None:
                self.on_round(report)
        return ended + self._leave()

    def _drop_cancelled(self) -> list[tuple[Hashable, Finished]]:
        if not self._cancelled:
            return []
        self.waiting = deque((k, r) for k, r in self.waiting if k not in self._cancelled)
        for seq in self.running:
            if seq.key in self._cancelled and not seq.stats.stop_reason:
                seq.stats.stop_reason = "cancelled"
        self._cancelled.clear()
        return self._leave()

    def _leave(self) -> list[tuple[Hashable, Finished]]:
        """Finished rows leave; the last running row moves into each freed slot."""
        ended = []
        slot = 0
        while slot < len(self.running):
            seq = self.running[slot]
            if not seq.stats.stop_reason:
                slot += 1
                continue
            ended.append((seq.key, Finished(seq.context[len(seq.request.prompt) : seq.length].tolist(), seq.stats)))
            last = self.running.pop()
            if last is not seq:
                self.target.move(len(self.running), slot, last.length - 1)
                self.drafter.move(len(self.running), slot)
                self.running[slot] = last
        return ended


def decode_batch(target: Model, drafter: Drafter, requests: Sequence[Request], *, draft_len: int,
                 eos_ids: frozenset[int], on_token: Callable[[int, int], None] | None = None,
                 schedule: DraftSchedule | None = None, per_sequence: bool = False,
                 adaptive: Callable[[], DepthPolicy] | None = None) -> list[Finished]:
    """Decode every request, up to ``target.slots`` at a time, each exactly as it would decode
    alone (greedy: the same tokens; sampled: the same distribution). ``on_token(index, token)``
    sees each emitted token. ``schedule``: each round drafts at most its depth for the number of
    running sequences (and ``draft_len``). ``per_sequence``: each round's verify width, under
    that cap, from the rows' own acceptance and the measured batch costs (runtime/goodput.py).
    ``adaptive``: makes each sequence's own DepthPolicy (its depth under the cap, as alone)."""
    loop = BatchLoop(target, drafter, draft_len=draft_len, eos_ids=eos_ids, on_token=on_token,  # type: ignore[arg-type]
                     schedule=schedule, per_sequence=per_sequence, adaptive=adaptive)
    for index, request in enumerate(requests):
        loop.submit(index, request)
    finished: dict[Hashable, Finished] = {}
    while loop.busy:
        finished.update(loop.step())
    return [finished[i] for i in range(len(requests))]


@dataclass
class _Prefill:
    """A prefill of this step: its prompt, its slot and the outputs the drafter joined with."""

    prompt: np.ndarray  # [n] int64
    slot: int
    extras: dict[str, np.ndarray]


def _start(target: Model, drafter: Drafter, slot: int, key: Hashable, request: Request, draft_len: int,
           shared: _Prefill | None = None) -> tuple[_Running, _Prefill]:
    """Prefill the request into ``slot`` (all but the last prompt token). ``shared``: a prefill of
    the same prompt this step, whose cache row is copied instead (n completions of one prompt
    pay for one prefill; a batched target's slots are rows of one host cache)."""
    prompt = np.asarray(request.prompt, dtype=np.int64)
    context = np.zeros(target.max_seq_len + 1, dtype=np.int64)
    context[: len(prompt)] = prompt
    stats = DecodeStats(draft_len=draft_len)
    start = time.perf_counter()
    runner = target.runners[slot]
    if shared is not None and target.caches.tensors is not None:
        target.move(shared.slot, slot, len(prompt) - 1)
        runner.cache.set_length(len(prompt) - 1)
        extras = shared.extras
    else:
        runner.cache.set_length(0)
        extras = runner.forward(prompt[:-1], want=drafter.needs).extras  # the last prompt token opens round one
    drafter.join(slot, prompt, extras)
    stats.prefill_s = time.perf_counter() - start
    return _Running(key, request, context, len(prompt), stats), _Prefill(prompt, slot, extras)


@dataclass
class _Widths:
    """Per-sequence depth's state over one batched decode: the acceptance of each draft tag
    (the n-gram match length, say), pooled over all rows with DepthPolicy's prior and
    forgetting, and the rounds since drafts were last verified (a probe every
    ``policy.probe_every`` rounds that chose no drafts, so an estimate can recover)."""

    policy: DepthPolicy
    skipped: int = 0

    def choose(self, target: Model, drafts: list[Draft], rows: int, width: int, default_tag: str) -> int:
        batch = target.batch_for(rows)
        built = target.widths(rows)
        holding = [w for w in built if w >= width][:1] or built[-1:]  # the narrowest holding every draft
        rates = [self.policy.alpha(d.tag or default_tag) for d in drafts]
        chosen = best_width([w for w in built if w < width] + holding, lambda w: target.costs[(batch, w)],
                            rates, [d.size for d in drafts])
        self.skipped = self.skipped + 1 if chosen == 1 else 0
        if self.skipped >= self.policy.probe_every:
            self.skipped, chosen = 0, holding[0]
        return chosen


def _round(target: Model, drafter: Drafter, running: list[_Running], draft_len: int,
           eos_ids: frozenset[int], on_token: Callable[[Hashable, int], None] | None,
           widths: _Widths | None = None) -> RoundReport:
    """One draft -> verify -> accept -> commit round over every running sequence."""
    start = time.perf_counter()
    ks = _depths(drafter, running, draft_len, target.max_seq_len)
    drafts = _draft(drafter, running, ks, start)
    drafts, out, report = _verify(target, drafter, running, drafts, draft_len, widths)
    for r, (seq, draft) in enumerate(zip(running, drafts)):
        request = seq.request
        n_accepted, next_token = _accept(request, draft, out, r, _output(seq))
        # the drafter sees the row's outputs of its committed positions only (first token, accepted drafts)
        drafter.accept(r, n_accepted, next_token, {name: out[name][r, : 1 + n_accepted] for name in drafter.needs})
        for policy in (widths.policy if widths else None, seq.policy):
            if policy is not None:
                policy.update(draft.tag or drafter.name, draft.size, n_accepted)
        before = (seq.stats.proposed, seq.stats.accepted)
        _commit(seq, draft, n_accepted, next_token, eos_ids, on_token,
                out[LOGITS][r] if request.logprobs is not None else None)  # the rewind: the next run's length
        _settle_rules(seq)
        seq.stats.verified_tokens += 1 + draft.size
        report.proposed.append(seq.stats.proposed - before[0])
        report.accepted.append(seq.stats.accepted - before[1])
        seq.stats.verify_s += report.verify_s
        seq.stats.total_s += time.perf_counter() - start
    return report


def _tree_round(target: Model, drafter: Drafter, verifier: TreeVerifier, running: list[_Running], draft_len: int,
                max_nodes: int, top_k: int, eos_ids: frozenset[int],
                on_token: Callable[[Hashable, int], None] | None) -> RoundReport | None:
    """One round over token trees (runtime/tree.py) for every running row: draft a tree per row,
    verify them all in one pass of the batch's tree graph, walk each, keep each accepted path's
    cache (the verifier compacts it). Rows share the pass's width; each row's tree has its own
    shape (a confident drafter's is a chain). None, and nothing done, when the batch size has
    no tree graph, a row's cache cannot take it, or no row has a tree this round (a chain
    round runs)."""
    start = time.perf_counter()
    n = len(running)
    batch = verifier.batch_for(n)
    # one sequence: the tree's own budget; more: at most the schedule's width per row, as chains
    nodes = min(max_nodes, verifier.nodes, draft_len if n > 1 else max_nodes)
    if batch is None or nodes <= 0 or not all(verifier.fits(seq.length - 1, nodes, batch) for seq in running):
        return None
    depths = _depths(drafter, running, draft_len, target.max_seq_len)
    for seq in running:  # each adaptive row calibrates its own weights; the others are taken as they are
        if seq.policy is not None and seq.tree_sizer is None:
            seq.tree_sizer = TreeSizer(verifier.cost)
    engine_before = drafter.engine_seconds
    # the loop keeps a tree verifier for tree drafters only (BatchLoop.__init__); an adaptive row
    # alone has its drafter stop growing where the size below would cut
    rows = [_draft_row(seq, _size_hint(seq.tree_sizer, verifier, drafter) if n == 1 else None) for seq in running]
    trees = cast(TreeDrafter, drafter).propose_trees(rows, depths, nodes, top_k)
    # nodes the grammar forbids are not verified
    trees = [seq.request.rules.valid_tree(_output(seq), tree) if tree is not None and seq.request.rules is not None
             else tree for seq, tree in zip(running, trees)]
    draft_s, draft_engine_s = time.perf_counter() - start, drafter.engine_seconds - engine_before
    for seq in running:  # every row waits for the whole draft, as for the verify pass
        seq.stats.draft_s += draft_s
        seq.stats.draft_engine_s += draft_engine_s
    if all(tree is None or tree.size == 0 for tree in trees):
        return None
    drafted = [tree if tree is not None else _NO_TREE for tree in trees]
    if any(seq.policy is not None for seq in running):  # adaptive: the trees' best shared size at this batch
        sizers = [seq.tree_sizer or TreeSizer(verifier.cost) for seq in running]
        keep = shared_size(sizers, drafted, lambda rows: verifier.cost(rows, batch))
        drafted = [tree.best(keep) if tree.size > keep else tree for tree in drafted]
    sampled = any(seq.request.needs_logits for seq in running)
    before = verifier.seconds
    outs = verifier.run_rows(batch, {r: (seq.length - 1, int(seq.context[seq.length - 1]), tree)
                                     for r, (seq, tree) in enumerate(zip(running, drafted))}, sampled, drafter.needs)
    verify_s = verifier.seconds - before
    report = RoundReport(n, batch, 1 + max(tree.size for tree in drafted), draft_len, [], [], verify_s)
    for r, (seq, tree) in enumerate(zip(running, drafted)):
        _settle_tree(seq, r, tree, outs[r], drafter, verifier, eos_ids, on_token, report)
        seq.stats.verify_s += verify_s
        seq.stats.total_s += time.perf_counter() - start
    return report


_NO_TREE = DraftTree(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # a row verifying its root alone


def _settle_tree(seq: _Running, r: int, tree: DraftTree, out: dict[str, np.ndarray], drafter: Drafter,
                 verifier: TreeVerifier, eos_ids: frozenset[int], on_token: Callable[[Hashable, int], None] | None,
                 report: RoundReport) -> None:
    """Row r after the tree pass: walk its tree, compact its cache, tell the drafter, commit."""
    request, length = seq.request, seq.length - 1  # the cache holds every committed token but the last
    path, next_token = _accept_tree(request, tree, out, _output(seq))
    verifier.commit(length, path, r)
    rows = [0, *(1 + p for p in path)]  # the verify rows of the committed positions
    drafter.accept(r, len(path), next_token, {name: out[name][rows] for name in drafter.needs})
    deepest = int(tree.depths().max()) if tree.size else 0
    if seq.policy is not None and tree.size:
        seq.policy.update(tree.tag or drafter.name, deepest, len(path))
    if seq.tree_sizer is not None:
        seq.tree_sizer.update(tree, len(path))
    # committed as a chain round whose drafts were the path, offered to the tree's depth
    offered = Draft(np.concatenate((tree.tokens[path], np.zeros(deepest - len(path), dtype=np.int64))), tag=tree.tag)
    counted = (seq.stats.proposed, seq.stats.accepted)
    _commit(seq, offered, len(path), next_token, eos_ids, on_token,
            out[LOGITS][rows] if request.logprobs is not None else None)
    _settle_rules(seq)
    seq.stats.tree_nodes += tree.size
    seq.stats.verified_tokens += 1 + tree.size
    report.proposed.append(seq.stats.proposed - counted[0])
    report.accepted.append(seq.stats.accepted - counted[1])


def _accept_tree(request: Request, tree: DraftTree, out: dict[str, np.ndarray],
                 output: np.ndarray) -> tuple[list[int], int]:
    """The tree's acceptance rule (runtime/tree.py): greedy on the graph's argmax, or on each
    node's logits ruled with the output and its path; sampled, rejection over siblings."""
    if request.rules is None and request.sampling.greedy:
        return tree_greedy(tree, lambda r: int(out[NEXT_TOKENS][r]))

    def row(r: int) -> np.ndarray:  # [V] row r's logits, ruled with the output and the path to it
        if request.rules is None:
            return out[LOGITS][r]
        return request.rules.apply(out[LOGITS][r], np.concatenate((output, tree.tokens[tree.path(r - 1)])))

    if request.sampling.greedy:
        return tree_greedy(tree, lambda r: int(np.argmax(row(r))))
    return tree_rejection(tree, lambda r: warp_row(row(r), request.sampling), request.rng)


def _accept(request: Request, draft: Draft, out: dict[str, np.ndarray], r: int,
            output: np.ndarray) -> tuple[int, int]:
    """Row r's acceptance rule: (accepted drafts, next token). Greedy reads the graph's argmax
    [1+k]; with rules, or sampling, the logits [1+k, V], row i ruled with the output before it
    (the committed ``output``, then drafts[:i]) and, sampling, warped for rejection."""
    if request.rules is None and request.sampling.greedy:
        return greedy(draft.tokens, out[NEXT_TOKENS][r, : 1 + draft.size])
    rows = out[LOGITS][r, : 1 + draft.size]  # [1+k, V]
    if request.rules is not None:
        rows = RuledRows(rows, request.rules, output, draft.tokens)
    if request.sampling.greedy:
        return greedy_walk(draft.tokens, rows)
    return rejection(draft, Warped(rows, request.sampling), request.rng)


def _depths(drafter: Drafter, running: list[_Running], draft_len: int, max_seq_len: int) -> list[int]:
    """Each row's depth: the round's, within its cache and its token budget (0: it only
    verifies), then as its own adaptive depth chooses."""
    ks = [min(draft_len, max_seq_len - seq.length, seq.request.max_new_tokens - seq.stats.tokens - 1)
          for seq in running]
    return [seq.policy.best_depth(drafter.name, k) if seq.policy is not None else k for seq, k in zip(running, ks)]


def _draft(drafter: Drafter, running: list[_Running], ks: list[int], start: float) -> list[Draft]:
    """One proposal for every row (a prefix kept where adaptive depth trims one that exists)."""
    engine_before = drafter.engine_seconds
    drafts = drafter.propose([_draft_row(seq) for seq in running], ks)
    drafts = [seq.policy.trim(d, drafter.name) if seq.policy is not None else d for seq, d in zip(running, drafts)]
    # a draft the grammar forbids would end the accepted run there: it is not verified at all
    drafts = [d.trimmed(seq.request.rules.valid_drafts(_output(seq), d.tokens)) if seq.request.rules is not None
              and d.size else d for seq, d in zip(running, drafts)]
    draft_s, draft_engine_s = time.perf_counter() - start, drafter.engine_seconds - engine_before
    for seq in running:  # every row waits for the whole draft, as for the verify pass
        seq.stats.draft_s += draft_s
        seq.stats.draft_engine_s += draft_engine_s
    return drafts


def _draft_row(seq: _Running, tree_size: SizeHint | None = None) -> DraftRow:
    """What the drafter sees of a running sequence."""
    request = seq.request
    return DraftRow(seq.context[: seq.length], request.sampling, request.rng, request.rules, len(request.prompt),
                    tree_size)


def _size_hint(sizer: TreeSizer | None, verifier: TreeVerifier, drafter: Drafter) -> SizeHint | None:
    """The size an adaptive sequence verifying alone will cut its tree to, counting the
    drafter's steps down to its deepest node (None: a fixed-size row). Not at B > 1: there the
    rows share one size, which may give a row more nodes than its own tree would choose."""
    if sizer is None:
        return None
    return lambda weights, depths, drafted: sizer.size_ranked(weights, depths, verifier.cost, drafted,
                                                              drafter.round_cost)


def _verify(target: Model, drafter: Drafter, running: list[_Running], drafts: list[Draft], draft_len: int,
            widths: _Widths | None) -> tuple[list[Draft], dict[str, np.ndarray], RoundReport]:
    """One target run over every row, [last, d1..dk] at the row's cache length, right-padded to
    the longest: the drafts it verified (trimmed to what the graph holds), its outputs (next_tokens
    [B, T], logits [B, T, V] when a row samples, the drafter's needs) and the round's report."""
    n = len(running)
    # an in-place graph checks the padded length against the cache: the width fits every row
    room = min(target.max_seq_len - (seq.length - 1) for seq in running)
    width = min(1 + max(d.size for d in drafts), room)
    if widths is not None and width > 1:  # the width with the most expected tokens per second of verify
        width = widths.choose(target, drafts, n, width, drafter.name)
    holds = target.holds(n, width)
    drafts = [d if 1 + d.size <= holds else d.trimmed(holds - 1) for d in drafts]
    sampled = any(seq.request.needs_logits for seq in running)
    rows = {r: (seq.length - 1, np.concatenate((seq.context[seq.length - 1 : seq.length], d.tokens)), {})
            for r, (seq, d) in enumerate(zip(running, drafts))}
    before = target.seconds
    out = target.run(n, rows, sampled, drafter.needs)
    verify_s = target.seconds - before
    graph = target.graph(n, min(width, holds))  # (B, T) of the verify graph
    if widths is not None:
        target.costs[graph] = observed(target.costs.get(graph), verify_s)
    return drafts, out, RoundReport(n, graph[0], graph[1], draft_len, [], [], verify_s)


def _settle_rules(seq: _Running) -> None:
    """After a round's commit: the sequence's rules (its grammar) move past the new output, and
    their costs go to its stats."""
    rules = seq.request.rules
    if rules is None:
        return
    if not seq.stats.stop_reason:
        rules.commit(_output(seq))
    seq.stats.rules_s, seq.stats.ruled_rows = rules.seconds, rules.rows


def _output(seq: _Running) -> np.ndarray:
    """The sequence's committed output tokens [m]."""
    return seq.context[len(seq.request.prompt) : seq.length]


def _commit(seq: _Running, draft: Draft, n_accepted: int, next_token: int, eos_ids: frozenset[int],
            on_token: Callable[[Hashable, int], None] | None, logits: np.ndarray | None = None) -> None:
    """The round's tokens, cut where the sequence stops: EOS, a stop string, the token budget, a
    full cache. Decided before any is yielded, so the stats count exactly the tokens emitted.
    ``logits`` [T, V]: the row's verify logits, for the request's logprobs."""
    stats, request = seq.stats, seq.request
    emitted = 0
    for token in (*draft.tokens[:n_accepted].tolist(), next_token):
        if logits is not None and request.logprobs is not None:
            request.logprobs.add(logits[emitted], token)
        seq.context[seq.length] = token
        seq.length += 1
        emitted += 1
        stopped = request.stop is not None and request.stop(token)
        stats.stop_reason = ("eos" if token in eos_ids else "stop_string" if stopped
                             else "max_new_tokens" if stats.tokens + emitted >= request.max_new_tokens
                             else "kv_full" if seq.length >= len(seq.context) else "")
        if on_token is not None:
            on_token(seq.key, token)
        if stats.stop_reason:
            break
    stats.count_round(draft.size, n_accepted, emitted)
