"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit, for every
running sequence at once. A lone request (``generate``) is a batch of one.

Each running sequence owns a slot, a row of the target's cache, and its own state: committed
tokens, position, sampling, stops, stats, adaptive depth. Cache invariant: a row's cache holds
every committed token but the last one, the root of the row's proposal. A round plans how much
each row drafts (runtime/policy.py), drafts a proposal per row (a token tree; a chain is a tree
whose nodes each have one child), verifies every row's [root, nodes...] in one pass
(runtime/verifier.py), scores each row's outputs through the logits stage
(runtime/target_rows.py), accepts a path and the next token (acceptance.accept), and commits
them: the verifier keeps the path's cache, the drafter and the policy hear what was kept.
Sequences join free slots between rounds (each prefilled alone, at batch 1, into its row) and
leave when done; running rows stay at the front of the cache, so a round runs the smallest
built batch that holds them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np

from specexport.contract import LOGITS, DraftSchedule
from specexport.runtime.acceptance import Sampling, accept
from specexport.runtime.adaptive import DepthPolicy
from specexport.runtime.drafter_set import DrafterSet
from specexport.runtime.drafters import Drafter, DraftRow
from specexport.runtime.logprobs import Logprobs
from specexport.runtime.model import Model
from specexport.runtime.policy import RoundPlan, SpeculationPolicy
from specexport.runtime.round_prices import RoundPrices
from specexport.runtime.rules import SequenceRules
from specexport.runtime.stats import DecodeStats
from specexport.runtime.target_rows import TargetRows
from specexport.runtime.tree import DraftTree, SizeHint
from specexport.runtime.tree_verify import TreeVerifier


@dataclass
class Request:
    prompt: np.ndarray  # [n] int64, n >= 1
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    # sees each emitted token (the request's text tracker: it detokenizes and finds stop
    # strings); True ends the sequence after that token
    watch: Callable[[int], bool] | None = None
    rules: SequenceRules | None = None  # penalties, biases, grammar: applied to every row the target scores
    logprobs: Logprobs | None = None  # filled with each emitted token's log probabilities
    max_depth: int | None = None  # drafts a round at most for this request (0: the target alone; None: the loop's)
    drafter: str | None = None  # a loop over a DrafterSet: the member drafting for it (None: the set's default)

    @property
    def needs_logits(self) -> bool:
        """Its rows are chosen from logits, not the graph's argmax."""
        return not self.sampling.greedy or self.rules is not None or self.logprobs is not None


@dataclass
class Finished:
    tokens: list[int]
    stats: DecodeStats


@dataclass
class Running:
    key: Hashable  # the request's key: its index in a batch, the server's request id
    request: Request
    context: np.ndarray  # [S_max + 1] committed tokens: prompt + output
    length: int  # committed tokens; the cache holds length - 1 of them
    stats: DecodeStats
    depth_policy: DepthPolicy | None = None  # this sequence's own adaptive depth and acceptance estimate
    drafter: str = ""  # the name of the drafter drafting for it (a DrafterSet's member)


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
    leave when done or cancelled. ``step()`` runs one round; the caller decides when (``run``
    steps until idle, the server's engine thread forever). Not thread-safe: one thread owns it.

    How much each round drafts is the policy's (runtime/policy.py): ``schedule`` caps the depth
    by the number of running rows; ``adaptive`` makes each sequence's own DepthPolicy under that
    cap; ``per_sequence`` then picks one batch-wide verify width for the rows' drafts;
    ``tree_verifier`` with ``tree_nodes`` > 0 verifies token trees where the drafter builds them;
    ``prices``: drafter -> its round prices, kept by the caller across loops (SpeculationPolicy)."""

    def __init__(self, target: Model, drafter: Drafter, *, draft_len: int, eos_ids: frozenset[int],
                 on_token: Callable[[Hashable, int], None] | None = None, schedule: DraftSchedule | None = None,
                 per_sequence: bool = False, on_round: Callable[[RoundReport], None] | None = None,
                 adaptive: Callable[[], DepthPolicy] | None = None, tree_verifier: TreeVerifier | None = None,
                 tree_nodes: int = 0, tree_top_k: int = 4, prices: dict[str, RoundPrices] | None = None):
        self.target, self.drafter, self.eos_ids = target, drafter, eos_ids
        self.on_token, self.on_round = on_token, on_round
        self.policy = SpeculationPolicy(target, drafter, draft_len=draft_len, schedule=schedule,
                                        per_sequence=per_sequence, adaptive=adaptive, trees=tree_verifier,
                                        tree_nodes=tree_nodes, tree_top_k=tree_top_k, prices=prices)
        self.waiting: deque[tuple[Hashable, Request]] = deque()
        self.running: list[Running] = []
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
            seq, last = _start(self.target, self.drafter, len(self.running), key, request, self.policy.draft_len,
                               shared, self.policy.drafts_joining(len(self.running) + 1, request))
            self.policy.start(seq)
            self.running.append(seq)
        if self.running:
            report = self._round()
            if self.on_round is not None:
                self.on_round(report)
        return ended + self._leave()

    def _round(self) -> RoundReport:
        """One draft -> verify -> accept -> commit round over every running sequence."""
        start = time.perf_counter()
        running, drafter, policy = self.running, self.drafter, self.policy
        plan = policy.plan(running)
        proposals = self._propose(plan, start)
        if plan.trees and not any(p.size for p in proposals):  # nothing drafted: the causal graph verifies the roots
            plan = policy.chain_round(plan)
        proposals = policy.fit(running, proposals, plan)
        sampled = any(seq.request.needs_logits for seq in running)
        roots = [(seq.length - 1, int(seq.context[seq.length - 1])) for seq in running]
        verified = plan.verifier.verify(roots, proposals, sampled, drafter.needs)
        report = RoundReport(len(running), verified.batch, verified.width, plan.cap, [], [], verified.seconds)
        for r, (seq, proposal, out) in enumerate(zip(running, proposals, verified.rows)):
            request = seq.request
            scored = TargetRows(out, proposal, request.sampling, request.rules, _output(seq))
            path, next_token = accept(proposal, scored, request.sampling, request.rng)
            plan.verifier.commit(seq.length - 1, path, r)
            kept = proposal.path_rows(path)  # the verify rows of the committed positions: root, accepted nodes
            # the drafter sees the row's outputs of its committed positions only, never a rejected one
            drafter.accept(r, len(path), next_token, {name: out[name][kept] for name in drafter.needs})
            policy.observe(seq, proposal, len(path), plan.trees)
            counted = (seq.stats.proposed, seq.stats.accepted)
            self._commit(seq, proposal, path, next_token, out[LOGITS][kept] if request.logprobs is not None else None)
            _settle_rules(seq)
            seq.stats.verified_tokens += 1 + proposal.size
            seq.stats.tree_nodes += proposal.size if plan.trees else 0
            report.proposed.append(seq.stats.proposed - counted[0])
            report.accepted.append(seq.stats.accepted - counted[1])
            seq.stats.verify_s += verified.seconds
        seconds = time.perf_counter() - start
        priced = policy.price_round(running, proposals, verified.batch, seconds) if not plan.trees else None
        for seq in running:
            seq.stats.total_s += seconds
            seq.stats.count_price(priced, seconds)
        return report

    def _propose(self, plan: RoundPlan, start: float) -> list[DraftTree]:
        """Every row's proposal: a tree in a tree round, else a chain cut to the prefix its
        adaptive depth keeps; a node the grammar forbids would end the accepted run there, so
        it is not verified at all."""
        running, drafter = self.running, self.drafter
        # a row at depth 0 runs no drafter engine: a plain round skips summing the drafter's
        # engine time over its graphs (15 us a round with SmolLM2's EAGLE-3 head: tens of graph calls)
        drafting = any(plan.depths)
        engine_before = drafter.engine_seconds if drafting else 0.0
        rows = [_draft_row(seq, hint) for seq, hint in zip(running, plan.hints or [None] * len(running))]
        proposals = drafter.propose(rows, plan.budget)
        if not plan.trees:  # a chain that exists is cut where its own tag says to
            proposals = [self.policy.trim(seq, p) for seq, p in zip(running, proposals)]
        proposals = [seq.request.rules.allowed(_output(seq), p) if seq.request.rules is not None and p.size else p
                     for seq, p in zip(running, proposals)]
        draft_s = time.perf_counter() - start
        draft_engine_s = drafter.engine_seconds - engine_before if drafting else 0.0
        for seq in running:  # every row waits for the whole draft, as for the verify pass
            seq.stats.draft_s += draft_s
            seq.stats.draft_engine_s += draft_engine_s
        return proposals

    def _commit(self, seq: Running, proposal: DraftTree, path: list[int], next_token: int,
                logits: np.ndarray | None) -> None:
        """The round's tokens, cut where the sequence stops: EOS, a stop string, the token budget, a
        full cache. Decided before any is yielded, so the stats count exactly the tokens emitted.
        ``logits`` [1+len(path), V]: the verify rows of the committed positions, for logprobs."""
        stats, request = seq.stats, seq.request
        emitted = 0
        accepted = proposal.tokens[: len(path)] if proposal.is_chain else proposal.tokens[path]
        for token in (*accepted.tolist(), next_token):
            if logits is not None and request.logprobs is not None:
                request.logprobs.add(logits[emitted], token)
            seq.context[seq.length] = token
            seq.length += 1
            emitted += 1
            stopped = request.watch is not None and request.watch(token)
            stats.stop_reason = ("eos" if token in self.eos_ids else "stop_string" if stopped
                                 else "max_new_tokens" if stats.tokens + emitted >= request.max_new_tokens
                                 else "kv_full" if seq.length >= len(seq.context) else "")
            if self.on_token is not None:
                self.on_token(seq.key, token)
            if stats.stop_reason:
                break
        # offered: the proposal's depth (a tree's deepest node), as a chain of that many drafts
        stats.count_round(proposal.depth, len(path), emitted)

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
            self.drafter.leave(slot, seq.context[: seq.length], len(seq.request.prompt))
            last = self.running.pop()
            if last is not seq:
                self.target.move(len(self.running), slot, last.length - 1)
                self.drafter.move(len(self.running), slot)
                self.running[slot] = last
        return ended


@dataclass
class _Prefill:
    """A prefill of this step: its prompt, its slot and the outputs the drafter joined with."""

    prompt: np.ndarray  # [n] int64
    slot: int
    extras: dict[str, np.ndarray]


def _start(target: Model, drafter: Drafter, slot: int, key: Hashable, request: Request, draft_len: int,
           shared: _Prefill | None = None, drafts: bool = True) -> tuple[Running, _Prefill]:
    """Prefill the request into ``slot`` (all but the last prompt token). ``shared``: a prefill of
    the same prompt this step, whose cache row is copied instead (n completions of one prompt
    pay for one prefill; a batched target's slots are rows of one host cache). ``drafts``: the
    sequence may draft in its first round, so the drafter's own prefill runs now too (else at
    its first draft, if any: Drafter.prefill)."""
    prompt = np.asarray(request.prompt, dtype=np.int64)
    context = np.zeros(target.max_seq_len + 1, dtype=np.int64)
    context[: len(prompt)] = prompt
    stats = DecodeStats(draft_len=draft_len if request.max_depth is None else min(draft_len, request.max_depth))
    start = time.perf_counter()
    runner = target.runners[slot]
    if shared is not None and target.caches.store is not None:
        target.move(shared.slot, slot, len(prompt) - 1)
        runner.cache.set_length(len(prompt) - 1)
        extras = shared.extras
    else:
        runner.cache.set_length(0)
        extras = runner.forward(prompt[:-1], want=drafter.needs).extras  # the last prompt token opens round one
    drafting = drafter.name
    if isinstance(drafter, DrafterSet):  # the request's member drafts for the slot
        drafter.assign(slot, request.drafter)
        drafting = drafter.of(slot).name
    drafter.join(slot, prompt, extras)
    if drafts:
        drafter.prefill(slot)
    stats.prefill_s = time.perf_counter() - start
    return Running(key, request, context, len(prompt), stats, drafter=drafting), _Prefill(prompt, slot, extras)


def _draft_row(seq: Running, tree_size: SizeHint | None = None) -> DraftRow:
    """What the drafter sees of a running sequence."""
    request = seq.request
    return DraftRow(seq.context[: seq.length], request.sampling, request.rng, request.rules, len(request.prompt),
                    tree_size)


def _settle_rules(seq: Running) -> None:
    """After a round's commit: the sequence's rules (its grammar) move past the new output, and
    their costs go to its stats."""
    rules = seq.request.rules
    if rules is None:
        return
    if not seq.stats.stop_reason:
        rules.commit(_output(seq))
    seq.stats.rules_s, seq.stats.ruled_rows = rules.seconds, rules.rows


def _output(seq: Running) -> np.ndarray:
    """The sequence's committed output tokens [m]."""
    return seq.context[len(seq.request.prompt) : seq.length]
