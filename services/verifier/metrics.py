"""The verifier's Prometheus metrics, on a registry of its own (tests and embedders can run several verifiers
in one process; nothing touches prometheus-client's global default registry).

Counters and gauges are read from the engine when scraped (the engine keeps the counts anyway, so the hot path
pays nothing); the two latency histograms are observed as things happen: the target forward (timed by wrapping
the runner) and each drafter round trip (timed by drafter_status.TrackedProposer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.modeling.runner import ForwardOutput, ModelRunner, RowInput
from services.verifier.engine import Engine
from services.verifier.spec_stats import SpecDecodeStats

PREFIX = "specserve"
VLLM_PREFIX = "vllm:"  # vLLM's names for the engine series, so its dashboards and autoscalers read these
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


_VLLM_GAUGES = frozenset({"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"})


class EngineCollector(Collector):
    """vLLM's spec-decode family with Prometheus underscores, labelled model_name and method (the drafter name
    requests select; every attached drafter shows, at zero until it has drafted)."""

    def __init__(self, engine: Engine, model_name: str, drafter_names: Callable[[], Iterable[str]] = tuple):
        self.engine = engine
        self.model_name = model_name
        self.drafter_names = drafter_names

    def collect(self) -> Iterable[Metric]:
        by_method = dict(self.engine.stats_by_method)  # a copy: the engine's loop may add a method meanwhile
        for name in self.drafter_names():
            by_method.setdefault(name, SpecDecodeStats())
        labels = ["model_name", "method"]
        for name, attribute, doc in (
            ("num_drafts", "num_drafts", "Engine steps in which a request verified a non-empty draft."),
            ("num_draft_tokens", "num_draft_tokens", "Draft tokens verified."),
            ("num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
            ("num_fallbacks", "num_fallbacks",
             "Proposer calls that were late or failed; their requests ran with K = 0 for that step."),
            ("num_late_proposals", "num_late_proposals",
             ("Proposer calls that missed the step's draft deadline (a subset of the fallbacks): the drafter is "
              "too slow for the target's step, the signal to add drafter replicas.")),
        ):
            family = CounterMetricFamily(f"{PREFIX}_spec_decode_{name}", doc, labels=labels)
            for method, stats in by_method.items():
                family.add_metric([self.model_name, method], getattr(stats, attribute))
            yield family
        for name, attribute, doc in (
            ("num_accepted_tokens_per_pos", "accepted_per_position",
             "Drafts whose token at this position was accepted."),
            ("num_drafts_per_pos", "drafts_per_position",
             ("Drafts that proposed a token at this position (drafts differ in length, so this, not num_drafts, "
              "is the denominator of a position's acceptance).")),
        ):
            per_pos = CounterMetricFamily(f"{PREFIX}_spec_decode_{name}", doc, labels=[*labels, "position"])
            for method, stats in by_method.items():
                for position, value in enumerate(list(getattr(stats, attribute))):
                    per_pos.add_metric([self.model_name, method, str(position)], value)
            yield per_pos
        generated = dict(self.engine.generated_tokens)
        for name in by_method:
            generated.setdefault(name, 0)
        tokens = CounterMetricFamily(
            f"{PREFIX}_generation_tokens", "Output tokens committed, by the method that drafted for the request "
            "('none': speculation off).", labels=labels,
        )
        for method, value in generated.items():
            tokens.add_metric([self.model_name, method], value)
        yield tokens
        yield from self._breaker_metrics(by_method)
        yield from self._slot_gauges()
        yield from self._vllm_spec_decode(by_method)

    def _vllm_spec_decode(self, by_method: dict[str, SpecDecodeStats]) -> Iterable[Metric]:
        """vLLM's spec-decode counters: one series per model, summed over the drafters (vLLM has one)."""
        for name, attribute in (("num_drafts", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                                ("num_accepted_tokens", "num_accepted_tokens")):
            family = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_{name}", f"{name} (specserve_spec_decode_{name}"
                                         " summed over drafters)", labels=["model_name"])
            family.add_metric([self.model_name], sum(getattr(stats, attribute) for stats in by_method.values()))
            yield family
        per_pos = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens at each position, summed over drafters",
                                      labels=["model_name", "position"])
        totals: dict[int, int] = {}
        for stats in by_method.values():
            for position, value in enumerate(list(stats.accepted_per_position)):
                totals[position] = totals.get(position, 0) + value
        for position, value in sorted(totals.items()):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos

    def _breaker_metrics(self, methods: Iterable[str]) -> Iterable[Metric]:
        """Each drafter's circuit breaker (draft_breaker.py): open now, and how often it opened."""
        breakers = dict(self.engine.drafts.breakers)
        labels = ["model_name", "method"]
        degraded = GaugeMetricFamily(
            f"{PREFIX}_drafter_degraded", "1 while a drafter's circuit breaker is open: its calls were late or "
            "failed several times in a row, so its requests run with K = 0 without waiting while it is probed.",
            labels=labels,
        )
        openings = CounterMetricFamily(
            f"{PREFIX}_drafter_degraded_episodes", "Times a drafter's circuit breaker opened.", labels=labels,
        )
        for method in methods:
            if method == "none":
                continue
            breaker = breakers.get(method)
            degraded.add_metric([self.model_name, method], float(breaker is not None and breaker.is_open))
            openings.add_metric([self.model_name, method], breaker.num_openings if breaker else 0)
        yield degraded
        yield openings

    def _slot_gauges(self) -> Iterable[Metric]:
        usage = self.engine.runner.kv_usage
        for name, value, doc in (
            ("num_requests_running", self.engine.num_running, "Requests running (holding KV blocks)."),
            ("num_requests_waiting", self.engine.num_waiting,
             "Requests queued for a sequence slot (--max-num-seqs) or for KV blocks."),
            ("kv_cache_blocks_used", usage.used_blocks, "KV cache blocks held by running requests."),
            ("kv_cache_blocks_total", usage.total_blocks,
             f"KV cache blocks in the pool ({usage.block_size} tokens each; --kv-cache-memory-bytes)."),
            ("kv_cache_blocks_cached", usage.cached_blocks,
             "KV cache blocks findable by content for prefix caching (held or not)."),
            ("kv_cache_usage_perc", usage.fraction_used,
             "Fraction of the KV cache held by running requests, 0 to 1 (vLLM's name)."),
        ):
            for prefix in (f"{PREFIX}_", VLLM_PREFIX) if name in _VLLM_GAUGES else (f"{PREFIX}_",):
                gauge = GaugeMetricFamily(f"{prefix}{name}", doc, labels=["model_name"])
                gauge.add_metric([self.model_name], value)
                yield gauge
        for name, value, doc in (
            ("prefix_cache_queries", usage.prefix_cache.queries,
             "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."),
            ("prefix_cache_hits", usage.prefix_cache.hits,
             "Prompt tokens found in the prefix cache, whose prefill was skipped (vLLM's prefix_cache_hits)."),
            ("num_preemptions", self.engine.num_preemptions,
             "Requests whose KV blocks were taken back for others; they recompute when resumed (vLLM's name)."),
        ):
            for prefix in (f"{PREFIX}_", VLLM_PREFIX):
                counter = CounterMetricFamily(f"{prefix}{name}", doc, labels=["model_name"])
                counter.add_metric([self.model_name], value)
                yield counter


@dataclass(frozen=True)
class VerifierMetrics:
    registry: CollectorRegistry
    forward_seconds: Histogram  # labels: model_name, kind ("verify" or "prefill")
    drafter_round_trip_seconds: Histogram  # labels: model_name, drafter

    def observe_round_trip(self, model_name: str, drafter: str) -> Callable[[float], None]:
        child = self.drafter_round_trip_seconds.labels(model_name, drafter)
        return child.observe

    def attach(self, collector: EngineCollector) -> None:
        self.registry.register(collector)


def create_metrics() -> VerifierMetrics:
    registry = CollectorRegistry(auto_describe=True)
    forward = Histogram(
        f"{PREFIX}_verify_step_seconds",
        "Target forward time per engine step: 'verify' scores every decoding row's draft, 'prefill' prompt chunks.",
        ["model_name", "kind"],
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    round_trip = Histogram(
        f"{PREFIX}_drafter_round_trip_seconds",
        "Time from asking a drafter for one step's drafts to having them (successful calls).",
        ["model_name", "drafter"],
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    return VerifierMetrics(registry, forward, round_trip)


class TimedRunner:
    """A ModelRunner that times each forward; everything else goes to the wrapped runner unchanged."""

    def __init__(self, runner: ModelRunner, histogram: Histogram, model_name: str) -> None:
        self._runner = runner
        self._verify = histogram.labels(model_name, "verify")
        self._prefill = histogram.labels(model_name, "prefill")

    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        started = time.perf_counter()
        try:
            return self._runner.forward(rows)
        finally:
            # decode rows ask logits for every fed position ([last token, drafts...]); prefill chunks for <= 1
            verify = all(row.num_logits == len(row.token_ids) for row in rows)
            (self._verify if verify else self._prefill).observe(time.perf_counter() - started)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)
