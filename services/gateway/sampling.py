"""OpenAI request fields -> the verifier's GenerateRequest (SamplingParams + SpeculationParams).

OpenAI defaults are filled in here (temperature 1, top_p 1, penalties off) so the verifier receives explicit
values, for the fields that neither the request nor the model's generation_config.json sets (generation_defaults.py,
applied before); `max_tokens` is checked against the context window so the client gets vLLM's clear message instead of a
generation silently cut short. Values the schema accepts but the proto cannot carry as meant (a top_k beyond
uint32, a 64-bit signed seed, a temperature or top_p that float32 rounds to 0) are mapped here to what they mean.
"""

from __future__ import annotations

from typing import Any

from services.common.drafter_methods import PREDICTION
from services.common.sampling_rules import GREEDY_TEMPERATURE_EPS, MAX_BAD_WORD_TOKENS
from services.gateway.errors import ApiError
from services.gateway.schemas import SamplingFields
from services.gateway.verifier_client import pb

MIN_TOP_P = 1e-8  # below any vocabulary's top probability: keeps the most likely token only, as any smaller p
_UINT32_MAX = 2**32 - 1
_UINT64 = 2**64


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: max_model_len of them), or all when None."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 and max_model_len else keep
    return ids[-keep:] if 0 < keep < len(ids) else ids


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, field: str = "max_tokens") -> int:
    """`field`: the request field that asked for `requested` tokens, named in the 400 when they do not fit."""
    if max_model_len and prompt_len >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {prompt_len} tokens; shorten it.", param="prompt",
                       code="context_length_exceeded")
    if requested is None:
        return max(1, max_model_len - prompt_len) if max_model_len else 16
    if max_model_len and prompt_len + requested > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                            f"{requested} for the completion). Reduce the prompt or {field}.",
                       param=field, code="context_length_exceeded")
    return requested


def temperature_of(req: SamplingFields) -> float:
    """OpenAI's default 1; a temperature too small to divide logits by meaningfully (1e-45 is 0 or a denormal
    in float32, and logits / it overflow to NaN) is greedy, as the engine treats it, so both sides agree."""
    temperature = 1.0 if req.temperature is None else req.temperature
    return 0.0 if temperature < GREEDY_TEMPERATURE_EPS else temperature


def top_p_of(req: SamplingFields) -> float:
    """A top_p that float32 rounds to 0 would mean "disabled" on the wire; any p this small keeps the single
    most likely token, so send the smallest p that still says so."""
    return 1.0 if req.top_p is None else max(req.top_p, MIN_TOP_P)


def top_k_of(req: SamplingFields) -> int:
    """-1 and 0 disable top-k. A top_k at least the vocabulary's size keeps every token, i.e. is disabled too
    (the engine clamps it); one beyond the proto's uint32 is therefore sent as 0 = disabled, not refused."""
    top_k = req.top_k or 0
    return 0 if top_k < 0 or top_k > _UINT32_MAX else top_k


def choice_seed(seed: int, choice: int) -> int:
    """The wire seed of one choice: any 64-bit seed (negative ones too) taken mod 2**64, and `seed + choice`
    wrapping the same way, so n > 1 gets distinct reproducible streams and the same seed the same output."""
    return (seed + choice) % _UINT64


def bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences (its SamplingParams.update_from_tokenizer): each word as written,
    without leading spaces, and also with one leading space where that tokenizes to a different first token and
    as many tokens, so the word is banned both at the start of the text and inside it."""
    sequences: list[list[int]] = []
    for index, word in enumerate(words):
        plain = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        if max(len(plain), len(spaced)) > MAX_BAD_WORD_TOKENS:
            raise ApiError(400, f"bad_words[{index}] is {max(len(plain), len(spaced))} tokens; at most "
                                f"{MAX_BAD_WORD_TOKENS} each", param="bad_words")
        sequences.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [ids for ids in sequences if ids]


def predicted_ids(tokenizer: Any, text: str | None, max_model_len: int) -> list[int] | None:
    """OpenAI's predicted output as the token ids the verifier drafts from (None without one, or an empty one, which
    predicts nothing: the request keeps the server's drafter). Longer than the model's context it could never be
    the output: a 400 at admission, not a draft source that cannot be used."""
    if not text:
        return None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) > max_model_len:
        raise ApiError(400, f"prediction is {len(ids)} tokens, longer than the model's context ({max_model_len}): "
                       "no output could follow it", param="prediction")
    return ids


def build_request(req: SamplingFields, *, request_id: str, prompt_ids: list[int], max_tokens: int,
                  choice: int, logprobs: int | None, prompt_logprobs: int | None = None,
                  structured_output: Any | None = None, bad_words: list[list[int]] = (),
                  prediction: list[int] | None = None) -> Any:
    """structured_output: a proto StructuredOutput that replaces the request's own (a forced tool call's);
    bad_words: the request's bad_words as token sequences (bad_words_ids); prediction: its predicted output's
    token ids (predicted_ids), drafted from by the verifier's "prediction" method."""
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                       param="min_tokens")
    sampling = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature_of(req),
        top_p=top_p_of(req),
        top_k=top_k_of(req),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        allowed_token_ids=req.allowed_token_ids or [],
        bad_words=[pb.TokenSequence(token_ids=ids) for ids in bad_words],
    )
    if req.seed is not None:
        sampling.seed = choice_seed(req.seed, choice)
    if logprobs is not None:
        sampling.logprobs = logprobs
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    sampling.logit_bias.update(req.logit_bias_ids())
    structured = structured_output if structured_output is not None else req.structured_output()
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    speculation = pb.SpeculationParams()
    if req.speculative_config is not None:
        speculation.method = req.speculative_config.method
        if req.speculative_config.num_speculative_tokens is not None:
            speculation.num_speculative_tokens = req.speculative_config.num_speculative_tokens
        if req.speculative_config.draft_pipelining is not None:
            speculation.draft_pipelining = req.speculative_config.draft_pipelining
    if prediction is not None:
        speculation.method = PREDICTION
        speculation.prediction_token_ids.extend(prediction)
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                              speculation=speculation)
