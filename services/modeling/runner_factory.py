"""Pick the fastest runner that supports a model."""

from __future__ import annotations

import logging

import torch

from services.modeling import llama_runner
from services.modeling.generic_runner import GenericRunner
from services.modeling.runner import ModelRunner

logger = logging.getLogger(__name__)


def create_runner(model: torch.nn.Module, max_num_seqs: int, max_model_len: int) -> ModelRunner:
    if llama_runner.supports(model):
        runner = llama_runner.LlamaFamilyRunner(model, max_num_seqs, max_model_len)
        logger.info(
            "model runner: batched llama-family runner, %s (kernel measurement took %.2f s)",
            runner.kernels,
            runner.kernel_measurement_s,
        )
        return runner
    logger.warning(
        "model type %r has no batched runner; using the generic transformers path (one row at a time)",
        getattr(model.config, "model_type", "?"),
    )
    return GenericRunner(model, max_num_seqs, max_model_len)
