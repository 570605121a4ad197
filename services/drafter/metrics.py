"""The drafter's Prometheus metrics, on a registry of its own (served by `specserve drafter --metrics-port`).

What the verifier cannot see from its side of the link: how long the proposer itself takes per step, how many
tokens it proposes, how often a verifier had to resync a sequence, and how much state it holds (streams and
open sequences, read from the servicer when scraped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "specserve_drafter"
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class StepObservation:
    """One answered Draft step."""

    seconds: float  # from receiving the step to having its reply
    num_sequences: int  # sequences in the step
    num_proposed_tokens: int  # draft tokens in the reply
    num_resyncs: int  # sequences answered with resync_needed


class DrafterMetrics:
    def __init__(self, method: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.method = method
        labels = ["method"]
        self._steps = Counter(f"{PREFIX}_steps", "Draft steps answered.", labels, registry=self.registry)
        self._sequences = Counter(
            f"{PREFIX}_sequences_drafted", "Sequence updates answered (one per sequence per step).", labels,
            registry=self.registry,
        )
        self._tokens = Counter(f"{PREFIX}_proposed_tokens", "Draft tokens proposed.", labels, registry=self.registry)
        self._resyncs = Counter(
            f"{PREFIX}_resyncs", "Sequences the verifier had to re-send whole (state lost or out of step).", labels,
            registry=self.registry,
        )
        self._seconds = Histogram(
            f"{PREFIX}_step_seconds", "Time to answer one Draft step (apply updates and propose).", labels,
            buckets=_STEP_BUCKETS, registry=self.registry,
        )

    def observe_step(self, step: StepObservation) -> None:
        self._steps.labels(self.method).inc()
        self._sequences.labels(self.method).inc(step.num_sequences)
        self._tokens.labels(self.method).inc(step.num_proposed_tokens)
        self._resyncs.labels(self.method).inc(step.num_resyncs)
        self._seconds.labels(self.method).observe(step.seconds)

    def watch_pipelining(self, counts: Callable[[], object]) -> None:
        """Report, when scraped, a model drafter's pre-drafts (draft_pipelining.PipelineCounts: used, discarded,
        hidden_seconds)."""
        self.registry.register(_PipelineCollector(self.method, counts))

    def watch_links(self, open_links: Callable[[], Iterable[int]]) -> None:
        """Report, when scraped, the open Draft streams and their sequences (`open_links` yields, per stream,
        its number of open sequences)."""
        self.registry.register(_LinkCollector(self.method, open_links))


class _LinkCollector(Collector):
    def __init__(self, method: str, open_links: Callable[[], Iterable[int]]) -> None:
        self.method = method
        self.open_links = open_links

    def collect(self) -> Iterable[Metric]:
        sizes = list(self.open_links())
        streams = GaugeMetricFamily(f"{PREFIX}_open_streams", "Draft streams open (verifier links).", labels=["method"])
        streams.add_metric([self.method], len(sizes))
        sequences = GaugeMetricFamily(
            f"{PREFIX}_open_sequences", "Sequences whose committed tokens the drafter holds.", labels=["method"]
        )
        sequences.add_metric([self.method], sum(sizes))
        return [streams, sequences]


class _PipelineCollector(Collector):
    def __init__(self, method: str, counts: Callable[[], object]) -> None:
        self.method = method
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        counts = self.counts()
        for name, value, doc in (
            ("predrafts_used", counts.used, "Pre-drafts answered: the guess that the whole draft was accepted held."),
            ("predrafts_discarded", counts.discarded, "Pre-drafts dropped: the guess failed, or a call stopped them."),
            ("predraft_hidden_seconds", counts.hidden_seconds,
             "Drafting seconds of the used pre-drafts: computed while the verifier verified, off its critical path."),
        ):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["method"])
            family.add_metric([self.method], value)
            yield family
