"""OpenAI request fields -> the verifier's GenerateRequest (SamplingParams + SpeculationParams).

OpenAI defaults are filled in here (temperature 1, top_p 1, penalties off) so the verifier receives explicit
values; `max_tokens` is checked against the context window so the client gets vLLM's clear message instead of a
generation silently cut short.
"""

from __future__ import annotations

from typing import Any

from services.gateway.errors import ApiError
from services.gateway.schemas import SamplingFields
from services.gateway.verifier_client import pb


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    if max_model_len and prompt_len >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {prompt_len} tokens; shorten it.", param="prompt",
                       code="context_length_exceeded")
    if requested is None:
        return max(1, max_model_len - prompt_len) if max_model_len else 16
    if max_model_len and prompt_len + requested > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                            f"{requested} for the completion). Reduce the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def build_request(req: SamplingFields, *, request_id: str, prompt_ids: list[int], max_tokens: int,
                  choice: int, logprobs: int | None) -> Any:
    sampling = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
    )
    if req.seed is not None:
        sampling.seed = req.seed + choice  # distinct but reproducible streams for n > 1
    if logprobs is not None:
        sampling.logprobs = logprobs
    speculation = pb.SpeculationParams()
    if req.speculative_config is not None:
        speculation.method = req.speculative_config.method
        if req.speculative_config.num_speculative_tokens is not None:
            speculation.num_speculative_tokens = req.speculative_config.num_speculative_tokens
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                              speculation=speculation)
