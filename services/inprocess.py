"""The verifier engine and a local drafter wired together in one process, for the CLI demo and the benchmark.

The deployed system runs the drafter as its own service over gRPC; this wiring uses the same Proposer protocol
with the proposer in-process, which is what makes "the service overhead" measurable against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.common.proposer import Proposer
from services.common.speculative_config import SpeculativeConfig
from services.drafter.ngram import NgramProposer, NgramSettings
from services.modeling.loading import LoadedModel, load_model
from services.modeling.runner_factory import create_runner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import SpeculationParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEngineOptions:
    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: the model's context, capped at 2048 to bound KV memory
    max_num_batched_tokens: int = 512
    speculative_config: SpeculativeConfig = field(
        default_factory=lambda: SpeculativeConfig(method="none", num_speculative_tokens=0)
    )


def local_proposers(config: SpeculativeConfig) -> dict[str, Proposer]:
    """The proposers that can run inside the verifier process. Model-based and suffix drafters run as drafter
    services (a later issue); asking for them here is a clear error, not a silent fallback."""
    if not config.enabled:
        return {}
    if config.method == "ngram":
        return {"ngram": NgramProposer(NgramSettings(config.prompt_lookup_min, config.prompt_lookup_max))}
    raise ValueError(f"speculative method {config.method!r} is not available in-process; supported here: ngram")


def default_speculation(config: SpeculativeConfig) -> SpeculationParams:
    if not config.enabled:
        return SpeculationParams()
    return SpeculationParams(config.method, config.num_speculative_tokens)


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def build_local_engine(options: LocalEngineOptions, loaded: LoadedModel | None = None) -> tuple[Engine, LoadedModel]:
    loaded = loaded or load_model(options.model, device=options.device, dtype=options.dtype)
    model_limit = int(getattr(loaded.model.config, "max_position_embeddings", 2048) or 2048)
    max_model_len = options.max_model_len or min(model_limit, 2048)
    if max_model_len > model_limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context ({model_limit})")
    runner = create_runner(loaded.model, options.max_num_seqs, max_model_len)
    engine = Engine(
        runner,
        EngineConfig(max_num_batched_tokens=options.max_num_batched_tokens),
        local_proposers(options.speculative_config),
        eos_token_ids(loaded),
    )
    logger.info(
        "engine ready: %s, max_num_seqs=%d, max_model_len=%d, speculation=%s",
        loaded.model_id,
        options.max_num_seqs,
        max_model_len,
        options.speculative_config.model_dump_json(exclude_defaults=False) if options.speculative_config.enabled else "off",
    )
    return engine, loaded
