"""The verifier engine and a local drafter wired together in one process, for the CLI demo and the benchmark.

The deployed system runs the drafter as its own service over gRPC; this wiring uses the same Proposer protocol
with the proposer in-process, which is what makes "the service overhead" measurable against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.common.drafter_methods import build_proposer
from services.common.proposer import Proposer, capabilities_of, vocabulary_mismatch
from services.common.speculative_config import SpeculativeConfig
from services.common.byte_size import parse_bytes
from services.modeling.context_length import resolve_max_model_len
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.paged_kv_cache import DEFAULT_BLOCK_SIZE
from services.modeling.loading import LoadedModel, load_model
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner_factory import create_runner
from services.modeling.step_graphs import GraphSettings
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import SpeculationParams
from services.verifier.structured_output import grammar_compiler_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEngineOptions:
    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False  # vLLM's: run the Python code a model's folder ships
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's whole context (modeling/context_length.py)
    max_num_batched_tokens: int = 512
    kv_cache_memory_bytes: str | None = None  # None: kv_budget.py's default share of available memory
    gpu_memory_utilization: float | None = None  # vLLM's: the share of the device's memory the instance holds
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    adaptive_speculation: bool = True
    enforce_eager: bool = False  # on an accelerator: no captured graphs (step_graphs.py)
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: step_graphs.default_capture_sizes
    batch_invariant: bool = False  # forwards of one fixed shape (batch_invariance.py)
    speculative_config: SpeculativeConfig = field(
        default_factory=lambda: SpeculativeConfig(method="none", num_speculative_tokens=0)
    )


class IncompatibleProposerError(ValueError):
    """The proposer drafts from another vocabulary or tokenizer than the target model's."""


def local_proposers(config: SpeculativeConfig, target: tuple[int, str] | None = None) -> dict[str, Proposer]:
    """The proposer `config` names, built in this process from the drafter method registry (the same module the
    drafter service runs); none when speculation is off. With `target` = (vocab_size, tokenizer fingerprint) of
    the target model, a proposer with a vocabulary of its own (a draft model) must match it, as a drafter service
    must match the verifier's."""
    if not config.enabled:
        return {}
    proposer = build_proposer(config)
    declared = capabilities_of(proposer)
    why = None if target is None else vocabulary_mismatch(declared.vocabulary, target)
    if why is not None:
        close = getattr(proposer, "close", None)
        if close is not None:
            close()
        raise IncompatibleProposerError(f"speculative method {config.method!r} {why}; choose a draft model that "
                                        "shares the target's tokenizer")
    return {config.method: proposer}


def default_speculation(config: SpeculativeConfig) -> SpeculationParams:
    if not config.enabled:
        return SpeculationParams()
    return SpeculationParams(config.method, config.verify_width)


def build_local_engine(options: LocalEngineOptions, loaded: LoadedModel | None = None) -> tuple[Engine, LoadedModel]:
    loaded = loaded or load_model(options.model, device=options.device, dtype=options.dtype,
                                  trust_remote_code=options.trust_remote_code)
    max_model_len = resolve_max_model_len(loaded.model, options.max_model_len)
    memory = parse_bytes(options.kv_cache_memory_bytes) if options.kv_cache_memory_bytes is not None else None
    kv_cache = KVCacheConfig(memory, options.block_size, options.enable_prefix_caching,
                             options.gpu_memory_utilization)
    graphs = GraphSettings(options.enforce_eager, tuple(options.cuda_graph_sizes or ()) or None)
    runner = create_runner(loaded.model, options.max_num_seqs, max_model_len, kv_cache, graphs=graphs,
                           batch_invariant=options.batch_invariant)
    engine = Engine(
        runner,
        EngineConfig(
            max_num_batched_tokens=options.max_num_batched_tokens, adaptive_speculation=options.adaptive_speculation
        ),
        local_proposers(options.speculative_config, (runner.vocab_size, tokenizer_fingerprint(loaded.tokenizer))),
        loaded.eos_token_ids,
        grammars=grammar_compiler_for(loaded.tokenizer, runner.vocab_size),
    )
    logger.info(
        "engine ready: %s, max_num_seqs=%d, max_model_len=%d, speculation=%s",
        loaded.model_id,
        options.max_num_seqs,
        max_model_len,
        options.speculative_config.model_dump_json(exclude_defaults=False) if options.speculative_config.enabled else "off",
    )
    return engine, loaded
