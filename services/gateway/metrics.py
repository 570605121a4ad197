"""Prometheus metrics of the gateway, on their own CollectorRegistry so several apps (tests, embedding) never
collide in the process-global registry.

Latencies are what users feel: time to first token and the gap between streamed steps (a step can commit
several tokens when drafts are accepted, so the gap is observed once per step, as vLLM V1 does). The
`specserve_spec_decode_*_total` counters aggregate the verifier's per-request speculation stats, named and
labelled like vLLM's spec-decode metrics so existing dashboards carry over.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specserve_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram("specserve_gateway_time_to_first_token_seconds",
                                             "Request start to first token of a choice",
                                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("specserve_gateway_inter_token_latency_seconds",
                                             "Gap between consecutive token messages of a choice",
                                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("specserve_gateway_e2e_request_latency_seconds",
                                     "Request start to last token", ["model_name"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specserve_gateway_prompt_tokens", "Prompt tokens", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("specserve_gateway_generation_tokens", "Generated tokens",
                                         ["model_name"], registry=r)
        labels = ["model_name", "method"]
        self.spec_num_drafts = Counter("specserve_spec_decode_num_drafts", "Drafting steps verified", labels,
                                       registry=r)
        self.spec_num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens verified",
                                             labels, registry=r)
        self.spec_num_accepted_tokens = Counter("specserve_spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted", labels, registry=r)

    def observe_speculation(self, model_name: str, method: str, drafts: int, draft_tokens: int,
                            accepted: int) -> None:
        if not method:
            return  # speculation was off for this request
        self.spec_num_drafts.labels(model_name, method).inc(drafts)
        self.spec_num_draft_tokens.labels(model_name, method).inc(draft_tokens)
        self.spec_num_accepted_tokens.labels(model_name, method).inc(accepted)
