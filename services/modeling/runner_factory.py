"""Pick the fastest runner that supports a model."""

from __future__ import annotations

import logging

import torch

from services.modeling import llama_runner
from services.modeling.generic_runner import GenericRunner
from services.modeling.host_threads import limit_host_threads
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.runner import ModelRunner
from services.modeling.step_graphs import GraphSettings

logger = logging.getLogger(__name__)


def create_runner(
    model: torch.nn.Module, max_num_seqs: int, max_model_len: int, kv_cache: KVCacheConfig | None = None,
    owns_model: bool = False, graphs: GraphSettings | None = None, batch_invariant: bool = False,
    allow_bf16: bool = False,
) -> ModelRunner:
    """owns_model: only the runner will call the model (a service process): one copy of each weight is kept
    (LlamaFamilyRunner). False where the same model object also runs elsewhere (transformers' generate in the
    bench, a test's shared fixture).
    graphs: captured step graphs on an accelerator (step_graphs.py); None: their defaults.
    batch_invariant: forwards of one fixed shape (batch_invariance.py); only the llama-family runner has them.
    allow_bf16: a drafter's model: float32 linears may run bfloat16 copies where measured faster (CPU; never a
    verifier's).
    On an accelerator the process's torch host threads drop to one (host_threads.py)."""
    limit_host_threads(next(model.parameters()).device)
    if llama_runner.supports(model):
        runner = llama_runner.LlamaFamilyRunner(model, max_num_seqs, max_model_len, kv_cache=kv_cache,
                                                owns_model=owns_model, graphs=graphs, batch_invariant=batch_invariant,
                                                allow_bf16=allow_bf16)
        logger.info(
            "model runner: batched llama-family runner, %s (kernel measurement took %.2f s; %.2f GiB of module "
            "weights freed: they run packed only)",
            runner.kernels,
            runner.kernel_measurement_s,
            runner.freed_weight_bytes / 2**30,
        )
        usage = runner.kv_usage
        pool_bytes = runner.cache.keys.nbytes + runner.cache.values.nbytes
        logger.info(
            "KV cache: %d tokens (%d blocks of %d, %.2f GiB), prefix caching %s; max_model_len=%d, max_num_seqs=%d; "
            "attention: %s",
            usage.total_blocks * usage.block_size, usage.total_blocks, usage.block_size, pool_bytes / 2**30,
            "on" if runner.cache.pool.enable_prefix_caching else "off", max_model_len, max_num_seqs,
            runner.attention_paths.describe(),
        )
        logger.info("step graphs: %s", runner.graphs.describe() if runner.graphs else "none, every forward eager")
        if runner.invariant is not None:
            shape = runner.invariant
            logger.info("batch-invariant forwards: waves of %d rows x %d tokens over %d positions",
                        shape.rows, shape.width, shape.span)
        return runner
    if batch_invariant:
        raise ValueError(f"--batch-invariant needs a llama-family model (llama, mistral, qwen2, qwen3); "
                         f"{getattr(model.config, 'model_type', '?')!r} runs on the generic runner")
    logger.warning(
        "model type %r has no batched runner; using the generic transformers path (one row at a time)",
        getattr(model.config, "model_type", "?"),
    )
    return GenericRunner(model, max_num_seqs, max_model_len)
