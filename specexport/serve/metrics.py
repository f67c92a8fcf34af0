"""The server's Prometheus metrics, on a registry of its own (never prometheus_client's global
one: two servers in one process, as in the tests or a Ray worker, must not share counters).

Speculative counters are named after vLLM's (num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos) under our prefix, so dashboards built for
vLLM's spec-decode panel need only the prefix changed. They count as DecodeStats does: drafts
after a stop (EOS, stop string, max_tokens) were never output and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specexport.runtime.loop import RoundReport
from specexport.runtime.suffix_store import ResponseStore

PREFIX = "specexport"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZES = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256)


class ServerMetrics:
    def __init__(self, model: str, draft_len: int):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.model = model
        self.running = gauge("num_requests_running", "Requests in the batch (one slot each).").labels(model)
        self.waiting = gauge("num_requests_waiting", "Requests queued for a slot.").labels(model)
        self.batch_size = gauge("batch_size", "Sequences in the last round.").labels(model)
        self.depth = gauge("draft_depth", "Draft depth the schedule allowed in the last round.").labels(model)
        self.batch_hist = histogram("round_batch_size", "Sequences per round.", _SIZES).labels(model)
        self.width_hist = histogram("round_verify_width", "Verify tokens per row per round (1 + drafts).",
                                    _SIZES).labels(model)
        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to its first token.",
                              _LATENCY_BUCKETS).labels(model)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time per output token after the first (a round's gap shared by its tokens).",
                             _LATENCY_BUCKETS).labels(model)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to its last token.",
                             _LATENCY_BUCKETS).labels(model)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(model)
        self.generation_tokens = counter("generation_tokens", "Tokens generated (served or not).").labels(model)
        self.success = counter("request_success", "Requests that finished.", ("finished_reason",))
        self.cancelled = counter("request_cancelled", "Requests whose client went away before the end.").labels(model)
        self.rejected = counter("request_rejected", "Requests answered with an error status.", ("status",))
        self.num_drafts = counter("num_drafts", "Verify rows that carried drafts.").labels(model)
        self.num_draft_tokens = counter("num_draft_tokens", "Draft tokens verified.").labels(model)
        self.num_accepted_tokens = counter("num_accepted_tokens", "Draft tokens accepted.").labels(model)
        self.accepted_per_pos = counter("num_accepted_tokens_per_pos", "Drafts accepted at each position.",
                                        ("position",))
        for position in range(draft_len):  # present from the start, so rates are defined
            self.accepted_per_pos.labels(model, str(position))

    def watch_stores(self, stores: Mapping[str, ResponseStore]) -> None:
        """Report the suffix drafters' stores of earlier responses (read at each scrape; a store
        made later, when its drafter is first used, shows up then)."""
        self.registry.register(_StoreCollector(self.model, stores))

    def round(self, report: RoundReport) -> None:
        self.batch_size.set(report.rows)
        self.depth.set(report.depth)
        self.batch_hist.observe(report.rows)
        self.width_hist.observe(report.width)
        for proposed, accepted in zip(report.proposed, report.accepted):
            if proposed:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(proposed)
                self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(self.model, str(position)).inc()

    def finished(self, reason: str) -> None:
        self.success.labels(self.model, reason).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    """The suffix stores' size and hit rate, labelled by drafter: tokens and responses held, an
    estimate of their memory, the rounds that looked in the store and those it drafted."""

    def __init__(self, model: str, stores: Mapping[str, ResponseStore]):
        self.model, self.stores = model, stores

    def collect(self) -> Iterator:
        stores = list(self.stores.items())
        if not stores:  # no suffix drafter with a store: no lines at all
            return
        labels = ["model_name", "drafter"]
        gauges = {key: GaugeMetricFamily(f"{PREFIX}_suffix_store_{key}", doc, labels=labels) for key, doc in (
            ("tokens", "Tokens of earlier responses in the suffix store."),
            ("responses", "Responses in the suffix store."),
            ("bytes", "Memory of the suffix store's index, estimated."),
            ("hit_rate", "Share of the store's lookups whose draft was proposed."))}
        counters = {key: CounterMetricFamily(f"{PREFIX}_suffix_store_{key}", doc, labels=labels) for key, doc in (
            ("lookups", "Rounds that looked in the suffix store."),
            ("hits", "Rounds whose draft came from the suffix store."),
            ("evicted", "Responses evicted from the suffix store for its budget."))}
        for name, store in stores:
            stats = store.stats()
            for key, gauge in gauges.items():
                gauge.add_metric([self.model, name], stats[key])
            for key, counter in counters.items():
                counter.add_metric([self.model, name], stats[key])
        yield from gauges.values()
        yield from counters.values()
