"""The verifier process: target model + engine behind the Verifier gRPC service, drafters reached over gRPC,
Prometheus metrics on their own HTTP port.

`start_verifier` takes an already-loaded model (tests and embedders use it with a tiny model and port 0);
`serve` loads `--model` and runs until SIGTERM; `run` is what `specserve verifier` (main.py) calls once its
flags parse.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.heap_trim import trim_heap
from services.common.grpc_server import GrpcServer, install_sigterm_handler, start_grpc_server
from services.common.run_once import RunOnce
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.common.metrics_http import MetricsEndpoint, serve_metrics
from services.common.speculative_config import SpeculativeConfig
from services.common.tls import channel_credentials
from services.modeling.compute_placement import choose_compute_thread
from services.modeling.context_length import resolve_max_model_len
from services.modeling.loading import LoadedModel
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.verifier.drafter_status import TrackedProposer
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.measurement_store import MeasurementStore, setup_identity
from services.verifier.metrics import EngineCollector, TimedRunner, create_metrics
from services.verifier.remote_proposer import IncompatibleDrafterError, RemoteProposer, RemoteProposerConfig
from services.verifier.servicer import VerifierServicer, status_for
from services.verifier.settings import VerifierSettings
from services.verifier.step_cost_cache import StepCostCache
from services.verifier.structured_output import GrammarCompiler, grammar_compiler_for
from services.verifier.wire import DefaultSpeculation, ModelFacts, verifier_pb2, verifier_pb2_grpc

logger = logging.getLogger(__name__)
PLACEMENT = "placement"  # the measurement store's kind for the forwards' thread

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name  # "specserve.v1.Verifier"


@dataclass
class RunningVerifier:
    grpc: GrpcServer
    engine: Engine
    drafters: list[TrackedProposer]
    metrics: MetricsEndpoint | None = None
    servicer: VerifierServicer | None = None
    _stopping: RunOnce = field(default_factory=lambda: RunOnce("specserve-verifier-stop"), repr=False)

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    async def stop(self, drain_s: float = 0.0, grace_s: float = 5.0) -> None:
        """NOT_SERVING (and GenerateMany calls start no more requests), let calls in flight finish for `grace_s`,
        then stop the engine and drafter links. Started once: a later call (serve's own exit, after a signal
        started the stop) waits for that stop to end rather than returning while the engine still shuts down."""
        await self._stopping.run(lambda: self._stop(drain_s, grace_s))

    async def _stop(self, drain_s: float, grace_s: float) -> None:
        if self.servicer is not None:
            self.servicer.drain()
        await self.grpc.graceful_stop(drain_s, grace_s)
        await self.engine.shutdown()
        for drafter in self.drafters:
            await drafter.close()
        if self.metrics is not None:
            self.metrics.stop()


def extract_dir(settings: VerifierSettings) -> Path | None:
    """extract_hidden_states' folder, created now so that a bad path stops start-up, not a request."""
    folder = settings.speculation.extract_dir
    if folder is None:
        return None
    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    logger.info("extract_hidden_states: every request's token ids and hidden states go to %s", path)
    return path


def default_speculation(settings: VerifierSettings, drafter_names: Sequence[str]) -> DefaultSpeculation:
    """The configured method when a drafter of that name is attached; with no --speculative-config, the only
    attached drafter; otherwise off. Never an error: speculation is an optimisation, the verifier still serves."""
    config = settings.speculation
    k = config.verify_width if config.enabled else SpeculativeConfig().num_speculative_tokens
    if not drafter_names:
        if config.enabled:
            logger.warning("--speculative-config asks for %r but no drafter is attached (--drafter name=host:port):"
                           " serving without speculation", config.method)
        return DefaultSpeculation(None, k)
    if settings.speculative_config is None:
        return DefaultSpeculation(drafter_names[0] if len(drafter_names) == 1 else None, k)
    if not config.enabled:
        return DefaultSpeculation(None, k)
    if config.method not in drafter_names:
        logger.warning("--speculative-config asks for %r but the attached drafters are named %s; requests run "
                       "without speculation unless they name one", config.method, ", ".join(drafter_names))
        return DefaultSpeculation(None, k)
    return DefaultSpeculation(config.method, k)


async def _attach_drafters(
    settings: VerifierSettings, vocab_size: int, fingerprint: str, model_id: str, metrics, hidden_size: int = 0,
    num_layers: int = 0,
) -> list[TrackedProposer]:
    """One RemoteProposer per --drafter. An unreachable drafter is only a warning (it may start later; its
    requests run with K = 0 until then); one that refuses this model's vocabulary stops startup."""
    credentials = channel_credentials(settings.drafter_tls_root_cert)
    drafters = []
    for name, address in settings.drafter_targets.items():
        config = RemoteProposerConfig(
            # no deadline of its own: the engine's (draft_deadline.py) cancels a late call
            address, vocab_size, fingerprint, hidden_size=hidden_size, num_layers=num_layers, step_timeout_s=None,
            channel_credentials=credentials,
        )
        proposer = RemoteProposer(config)
        if settings.hidden_layers is not None:  # fixed by the flag: a drafter reading other layers is refused now
            proposer.serve_hidden_layers(tuple(settings.hidden_layers))
        tracked = TrackedProposer(name, proposer, metrics.observe_round_trip(model_id, name))
        await tracked.probe()
        report = tracked.report()
        if report.state == verifier_pb2.DRAFTER_STATE_REFUSED:
            for drafter in [*drafters, tracked]:
                await drafter.close()
            raise IncompatibleDrafterError(report.detail)
        if report.state != verifier_pb2.DRAFTER_STATE_SERVING:
            logger.warning("drafter %s at %s not reachable yet (%s); will retry", name, address, report.detail)
        drafters.append(tracked)
    return drafters


async def start_verifier(
    model: torch.nn.Module,
    model_id: str,
    settings: VerifierSettings,
    eos_token_ids: Iterable[int] = (),
    tokenizer_fingerprint: str = "",
    runner: ModelRunner | None = None,
    compute: Executor | None = None,
    grammars: GrammarCompiler | None = None,
    step_cost_cache: StepCostCache | None = None,
) -> RunningVerifier:
    """Build runner (unless given), drafter links and engine around `model` and start serving (port 0: a free
    port). `tokenizer_fingerprint` (of the model's tokenizer) is published in Info and checked against drafters;
    `compute` is the executor for the engine's forwards (default: a worker thread of the engine's own);
    `grammars` compiles structured_output for the model's tokenizer (without it such requests are refused);
    `step_cost_cache` keeps the start-up cost profile for the next start (None: measured every start)."""
    credentials = settings.server_credentials()
    max_model_len = resolve_max_model_len(model, settings.max_model_len)
    metrics = create_metrics()
    runner = runner or create_runner(model, settings.max_num_seqs, max_model_len, settings.kv_cache,
                                     graphs=settings.graphs, batch_invariant=settings.batch_invariant)
    drafters = await _attach_drafters(settings, runner.vocab_size, tokenizer_fingerprint, model_id, metrics,
                                      int(getattr(model.config, "hidden_size", 0) or 0),
                                      int(getattr(model.config, "num_hidden_layers", 0) or 0))
    default = default_speculation(settings, [d.name for d in drafters])
    engine = Engine(
        TimedRunner(runner, metrics.forward_seconds, model_id),
        EngineConfig(
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_waiting_requests=settings.max_waiting_requests,
            draft_timeout_s=settings.draft_timeout_s,
            max_draft_timeout_s=settings.max_draft_timeout_s,
            log_stats_interval_s=settings.log_stats_interval_s,
            adaptive_speculation=settings.adaptive_speculation,
            extract_hidden_states_dir=extract_dir(settings),
            step_cost_cache=step_cost_cache,
            max_logprobs=settings.max_logprobs,
            seed=settings.seed,
            hidden_layers=tuple(settings.hidden_layers) if settings.hidden_layers is not None else None,
        ),
        {d.name: d for d in drafters},
        eos_token_ids,
        compute,
        grammars,
    )
    for drafter in drafters:  # from now on a drafter that reads other target layers is refused
        drafter.proposer.serve_hidden_layers(engine.hidden_layers)
    metrics.attach(EngineCollector(engine, model_id, lambda: [d.name for d in drafters]))
    facts = ModelFacts(
        model_id, max_model_len, runner.vocab_size, tuple(engine.eos_token_ids), runner.max_num_seqs,
        tokenizer_fingerprint, engine.max_logprobs,
    )
    servicer = VerifierServicer(
        engine, facts, default,
        lambda: [d.report(engine.num_fallbacks(d.name), engine.is_degraded(d.name)) for d in drafters],
    )
    await engine.start()
    for drafter in drafters:
        drafter.start_watching(settings.drafter_health_interval_s, functools.partial(engine.readmit, drafter.name))
    try:
        server = await start_grpc_server(
            lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
            [SERVICE_NAME],
            settings.host,
            settings.port,
            credentials=credentials,
            status_for=status_for,
        )
    except BaseException:
        await engine.shutdown()
        for drafter in drafters:
            await drafter.close()
        raise
    endpoint = serve_metrics(metrics.registry, settings.host, settings.metrics_port)
    running = RunningVerifier(server, engine, drafters, endpoint, servicer)
    return running


def measurement_store(settings: VerifierSettings) -> MeasurementStore | None:
    folder = settings.measurement_cache_dir
    return MeasurementStore(Path(folder).expanduser()) if folder else None


def place_forwards(
    settings: VerifierSettings, runner: ModelRunner, worker: Executor, store: MeasurementStore | None,
    setup: dict,
) -> str:
    """The thread for the forwards: as asked, or for "auto" as measured at an earlier start with this setup
    (measurement_store.py), or measured now (and kept)."""
    found = store.load(PLACEMENT, setup) if settings.compute_thread == "auto" and store is not None else None
    if found is not None and isinstance(found[0], dict) and found[0].get("thread") in ("main", "worker"):
        (stored, age) = found
        logger.info("model forwards run on the %s thread: %s (measured %.1f h ago, %s)", stored["thread"],
                    stored.get("timing"), age / 3600, store.path(PLACEMENT, setup))
        return stored["thread"]
    placement, timing = choose_compute_thread(settings.compute_thread, runner, worker)
    if timing is not None and store is not None:
        store.save(PLACEMENT, setup, {"thread": placement, "timing": timing.describe()})
    return placement


async def serve(
    settings: VerifierSettings, loaded: LoadedModel, runner: ModelRunner, compute: Executor,
    step_cost_cache: StepCostCache | None = None,
) -> int:
    """Serve the loaded model until SIGTERM/SIGINT, then stop gracefully."""
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    grammars = grammar_compiler_for(loaded.tokenizer, runner.vocab_size)
    running = await start_verifier(
        loaded.model, loaded.model_id, settings, loaded.eos_token_ids, fingerprint, runner, compute, grammars,
        step_cost_cache,
    )
    install_sigterm_handler(lambda: running.stop(settings.drain_s, settings.grace_s))
    trim_heap("verifier start-up done")
    scheme = "grpcs" if settings.tls_enabled else "grpc"
    print(f"verifier ({loaded.model_id}) listening on {scheme}://{settings.host}:{running.port}", flush=True)
    if running.metrics_port:
        print(f"metrics on http://{settings.host}:{running.metrics_port}/metrics", flush=True)
    await running.grpc.wait()
    await running.stop(0, 0)  # after a signal-driven stop: waits for it to end
    return 0


def run(settings: VerifierSettings) -> int:
    """Load `settings.model` and build its runner on the main thread, decide which thread runs the forwards
    (services/modeling/compute_placement.py), then serve: the asyncio loop stays on the main thread when the
    forwards go to a worker, and moves to a thread of its own when they run on the main thread."""
    from services.modeling.loading import load_model

    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype,
                        trust_remote_code=settings.trust_remote_code)
    max_model_len = resolve_max_model_len(loaded.model, settings.max_model_len)
    runner = create_runner(loaded.model, settings.max_num_seqs, max_model_len, settings.kv_cache, owns_model=True,
                           graphs=settings.graphs, batch_invariant=settings.batch_invariant)
    worker = worker_thread()
    store = measurement_store(settings)
    setup = setup_identity(loaded.model_id, loaded.model.config.to_json_string(), str(loaded.model.dtype),
                           runner.device)
    try:
        placement = place_forwards(settings, runner, worker, store, setup)
        costs = StepCostCache(store, setup, placement) if store is not None else None
        return run_with_compute(placement, worker, lambda compute: serve(settings, loaded, runner, compute, costs))
    finally:
        worker.shutdown(wait=True)


if __name__ == "__main__":
    from services.verifier.main import main

    raise SystemExit(main())
