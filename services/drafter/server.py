"""The drafter process: one proposer behind the Drafter gRPC service, Prometheus metrics on their own HTTP port.

`serve` is what tests and embedders use (any Proposer, any port, returns the bound port); `main` is the
`specserve drafter` command, which builds the proposer from its settings and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import replace

import grpc

from services.common.drafter_methods import build_proposer, method_names
from services.common.heap_trim import trim_heap
from services.common.drafter_wire import DrafterDescription, drafter_pb2, drafter_pb2_grpc
from services.common.grpc_server import GrpcServer, install_sigterm_handler, start_grpc_server
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.common.metrics_http import serve_metrics
from services.common.proposer import Proposer, capabilities_of
from services.drafter.metrics import DrafterMetrics
from services.drafter.servicer import DrafterServicer
from services.drafter.settings import DrafterSettings

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "specserve.v1.Drafter"


async def serve(
    proposer: Proposer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    num_speculative_tokens: int = 5,
    vocab_size: int | None = None,
    tokenizer_fingerprint: str | None = None,
    needs_hidden_states: bool | None = None,
    credentials: grpc.ServerCredentials | None = None,
    metrics: DrafterMetrics | None = None,
) -> tuple[GrpcServer, int]:
    """Start serving `proposer`; returns the running server and its bound port (a free one for port 0).
    `num_speculative_tokens`: the most draft tokens a sequence is asked for per step (Info's max_speculative_tokens:
    a chain's length, or a tree method's num_draft_tokens).
    `vocab_size`, `tokenizer_fingerprint` and `needs_hidden_states` (Info) default to what the proposer declares
    (its capabilities: a draft model its own vocabulary, ngram and suffix none, i.e. any); tests pass others to
    play a mismatched drafter."""
    declared = capabilities_of(proposer)
    overrides = {"vocab_size": vocab_size, "tokenizer_fingerprint": tokenizer_fingerprint,
                 "needs_hidden_states": needs_hidden_states}
    description = DrafterDescription(proposer.method, replace(
        declared, max_speculative_tokens=num_speculative_tokens,
        **{name: value for name, value in overrides.items() if value is not None}))
    servicer = DrafterServicer(proposer, description, metrics)
    server = await start_grpc_server(
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
        [SERVICE_NAME],
        host,
        port,
        credentials=credentials,
    )
    return server, server.port


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM-style flags. Unset flags leave the SPECSERVE_DRAFTER_* environment (or the default) in charge."""
    s = argparse.SUPPRESS
    parser.add_argument("--speculative-config", dest="speculative_config", default=s,
                        help='JSON as the verifier\'s, e.g. \'{"method": "suffix", "num_speculative_tokens": 8}\'')
    parser.add_argument("--method", default=s, help=f"one of {', '.join(method_names())} (default ngram)")
    parser.add_argument("--num-speculative-tokens", dest="num_speculative_tokens", type=int, default=s,
                        help="largest K served per step (default 5)")
    parser.add_argument("--prompt-lookup-min", dest="prompt_lookup_min", type=int, default=s)
    parser.add_argument("--prompt-lookup-max", dest="prompt_lookup_max", type=int, default=s)
    parser.add_argument("--model", default=s, help="draft_model: the draft model, sharing the target's vocabulary "
                        "(registered name, transformers folder, .gguf file or hub id)")
    parser.add_argument("--device", default=s,
                        help="draft_model, eagle: auto | cpu | cuda | cuda:N | npu | npu:N (default auto)")
    parser.add_argument("--dtype", default=s, help="draft_model: auto | float32 | bfloat16 | float16 (default auto)")
    parser.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=s,
                        help="draft_model: sequences that keep a KV slot; beyond, the least recently used one is "
                        "evicted and re-prefilled when it returns (default 16)")
    parser.add_argument("--max-model-len", dest="max_model_len", type=int, default=s,
                        help="draft_model: positions per KV slot; longer sequences get no draft (default: the "
                        "model's context, capped at 2048)")
    parser.add_argument("--enforce-eager", dest="enforce_eager", action=argparse.BooleanOptionalAction, default=s,
                        help="draft_model, eagle: on a GPU or NPU, run eagerly instead of replaying graphs captured "
                        "at start-up (default off)")
    parser.add_argument("--compute-thread", dest="compute_thread", choices=["auto", "main", "worker"], default=s,
                        help="draft_model: thread for the draft model's forwards; auto (default) measures both, "
                        "as the verifier does")
    parser.add_argument("--host", default=s, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=s, help="gRPC port (default 50061; 0 picks a free one)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int, default=s,
                        help="Prometheus /metrics HTTP port (default 8002; 0 turns metrics off)")
    parser.add_argument("--drain-seconds", dest="drain_s", type=float, default=s,
                        help="on SIGTERM, report NOT_SERVING this long before refusing new streams")
    parser.add_argument("--grace-seconds", dest="grace_s", type=float, default=s,
                        help="time for in-flight streams to end")
    parser.add_argument("--tls-cert-file", dest="tls_cert_file", default=s, help="PEM certificate chain: serve TLS")
    parser.add_argument("--tls-key-file", dest="tls_key_file", default=s, help="PEM private key of that certificate")


def settings_from_args(args: argparse.Namespace) -> DrafterSettings:
    return DrafterSettings(**{k: v for k, v in vars(args).items() if k in DrafterSettings.model_fields})


async def run(settings: DrafterSettings, proposer: Proposer) -> int:
    """Serve `proposer` (built from `settings`) until SIGTERM."""
    speculation = settings.speculation
    metrics = DrafterMetrics(proposer.method)
    if capabilities_of(proposer).pre_drafts:  # on for requests that ask, whatever its setting
        metrics.watch_pipelining(lambda: proposer.pipeline_counts)
    server, port = await serve(
        proposer,
        settings.host,
        settings.port,
        num_speculative_tokens=speculation.verify_width,
        credentials=settings.server_credentials(),
        metrics=metrics,
    )
    install_sigterm_handler(lambda: server.graceful_stop(settings.drain_s, settings.grace_s))
    trim_heap("drafter start-up done")
    scheme = "grpcs" if settings.tls_enabled else "grpc"
    print(f"drafter ({speculation.method}) listening on {scheme}://{settings.host}:{port}", flush=True)
    endpoint = serve_metrics(metrics.registry, settings.host, settings.metrics_port)
    if endpoint is not None:
        print(f"metrics on http://{settings.host}:{endpoint.port}/metrics", flush=True)
    try:
        await server.wait()
    finally:
        if endpoint is not None:
            endpoint.stop()
    return 0


def run_process(settings: DrafterSettings) -> int:
    """Build the proposer on the main thread, then serve it. A proposer with a model of its own (it has a `runner`
    and `use_compute`, e.g. draft_model) gets its forwards placed as the verifier engine's are
    (services/modeling/compute_placement.py): on the main thread where that thread's torch pool is measurably
    faster, the asyncio loop then moving beside it; on a worker thread otherwise. Other proposers run on the loop,
    and never import torch (an ngram or suffix drafter's install has none)."""
    proposer = build_proposer(settings.speculation)
    runner = getattr(proposer, "runner", None)
    if runner is None or not hasattr(proposer, "use_compute"):
        return asyncio.run(run(settings, proposer))
    from services.modeling.compute_placement import choose_compute_thread  # torch: model drafters only

    worker = worker_thread()
    try:
        placement, _ = choose_compute_thread(settings.compute_thread, runner, worker)

        async def serve_on(compute: Executor) -> int:
            proposer.use_compute(compute)
            return await run(settings, proposer)

        return run_with_compute(placement, worker, serve_on)
    finally:
        worker.shutdown(wait=True)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="specserve drafter", description="Serve one proposer over gRPC.")
    add_drafter_flags(parser)
    return run_process(settings_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
