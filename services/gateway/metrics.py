"""Prometheus metrics of the gateway, on their own CollectorRegistry so several apps (tests, embedding) never
collide in the process-global registry.

Latencies are what users feel: time to first token and the gap between streamed steps (a step can commit
several tokens when drafts are accepted, so the gap is observed once per step, as vLLM V1 does), labelled with
the speculation method that served the request ("none" when off) so methods can be compared. The
`specserve_gateway_spec_decode_*_total` counters sum the speculation stats of the requests the gateway
answered; the verifier's `specserve_spec_decode_*_total` count every verified step (aborted requests included)
and are what dashboards read. The names differ so that one query over every job never counts a draft twice.

vLLM's own names (`vllm:time_to_first_token_seconds`, ...; label `model_name`) are exposed beside them for the
request-level series the gateway measures, so a vLLM dashboard, alert or autoscaler works unchanged; the engine
series (running, waiting, KV cache, prefix cache, spec decode) come from the verifier. docs/architecture.md
lists the mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
NO_METHOD = "none"  # the method label of requests served without speculation


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        by_method = ["model_name", "method"]
        self.requests = Counter("specserve_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_success = Counter("specserve_gateway_request_success",
                                       "Choices finished, by finish reason (stop, length, abort)",
                                       ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = Histogram("specserve_gateway_time_to_first_token_seconds",
                                             "Request start to first token of a choice",
                                             by_method, buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("specserve_gateway_inter_token_latency_seconds",
                                             "Gap between consecutive token messages of a choice",
                                             by_method, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("specserve_gateway_e2e_request_latency_seconds",
                                     "Request start to last token", by_method,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specserve_gateway_prompt_tokens", "Prompt tokens", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("specserve_gateway_generation_tokens", "Generated tokens",
                                         ["model_name"], registry=r)
        self.spec_num_drafts = Counter("specserve_gateway_spec_decode_num_drafts",
                                       "Drafting steps verified, over answered requests", by_method, registry=r)
        self.spec_num_draft_tokens = Counter("specserve_gateway_spec_decode_num_draft_tokens",
                                             "Draft tokens verified, over answered requests", by_method,
                                             registry=r)
        self.spec_num_accepted_tokens = Counter("specserve_gateway_spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted, over answered requests", by_method,
                                                registry=r)

        # vLLM's names for the same quantities (no method label: vLLM has one drafter per server)
        model = ["model_name"]
        self.vllm_request_success = Counter("vllm:request_success", "Finished requests, by finish reason",
                                            ["model_name", "finished_reason"], registry=r)
        self.vllm_time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                                  model, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency",
                                                  model, buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_e2e_latency = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", model,
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", model, registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", model, registry=r)

    def observe_first_token(self, model_name: str, method: str, seconds: float) -> None:
        self.time_to_first_token.labels(model_name, method).observe(seconds)
        self.vllm_time_to_first_token.labels(model_name).observe(seconds)

    def token_gap_observer(self, model_name: str, method: str) -> Callable[[float], None]:
        """Observes the gap between a choice's messages for one (model, method), its labelled series looked up
        once: a choice observes a gap every step, and the two `labels` lookups cost about what the observations
        did."""
        ours = self.inter_token_latency.labels(model_name, method)
        vllm = self.vllm_inter_token_latency.labels(model_name)

        def observe(seconds: float) -> None:
            ours.observe(seconds)
            vllm.observe(seconds)

        return observe

    def observe_request(self, model_name: str, method: str, seconds: float, prompt_tokens: int,
                        generation_tokens: int) -> None:
        """One answered request, however it ended."""
        self.e2e_latency.labels(model_name, method).observe(seconds)
        self.vllm_e2e_latency.labels(model_name).observe(seconds)
        self.prompt_tokens.labels(model_name).inc(prompt_tokens)
        self.vllm_prompt_tokens.labels(model_name).inc(prompt_tokens)
        self.generation_tokens.labels(model_name).inc(generation_tokens)
        self.vllm_generation_tokens.labels(model_name).inc(generation_tokens)

    def observe_finished(self, model_name: str, finish_reasons: Iterable[str]) -> None:
        for reason in finish_reasons:
            self.request_success.labels(model_name, reason).inc()
            self.vllm_request_success.labels(model_name, reason).inc()

    def observe_speculation(self, model_name: str, method: str, drafts: int, draft_tokens: int,
                            accepted: int) -> None:
        if not method:
            return  # speculation was off for this request
        self.spec_num_drafts.labels(model_name, method).inc(drafts)
        self.spec_num_draft_tokens.labels(model_name, method).inc(draft_tokens)
        self.spec_num_accepted_tokens.labels(model_name, method).inc(accepted)
