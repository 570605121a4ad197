"""Per-request sampling and speculation parameters, validated once when a request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.method_options import MAX_SPECULATIVE_TOKENS
from services.common.sampling_rules import (
    GREEDY_TEMPERATURE_EPS,
    MAX_BAD_WORD_SEQUENCES,
    MAX_BAD_WORD_TOKENS,
    SEED_MAX,
    SEED_MIN,
)

# Every emitted token is checked against the stop ids on the engine's loop, which all requests share: a bound
# keeps one request's list from slowing everyone's steps.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar is compiled at admission: bound the work one request asks for
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class OutputGrammar:
    """The language the output must belong to (proto StructuredOutput): `kind` one of GRAMMAR_KINDS; `text` the
    JSON schema, regular expression, JSON list of choices or llguidance Lark / GBNF grammar ("" for json_object).
    Compiled against the target's tokenizer at admission (structured_output.py)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured_output kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_output is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"structured_output ({self.kind}) is empty")


@dataclass(frozen=True)
class SamplingParams:
    """What the target distribution looks like for one request, and when the request stops.

    The verifier applies these to every verified position (drafted ones included), so speculation never
    changes which distribution a token is drawn from. Field names follow the OpenAI / vLLM request bodies.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob plus n alternatives
    # None: off; n >= 0: each prompt token's logprob (after the first) under the raw target, plus n alternatives
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the raw logits at every position (ids are checked against the vocabulary
    # by the engine, which knows it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: OutputGrammar | None = None
    # vLLM's min_tokens: no end-of-sequence or stop token id before this many tokens are generated
    min_tokens: int = 0
    # vLLM's allowed_token_ids: when non-empty, the only tokens that may be generated
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token sequences: a sequence's last token is banned where the output ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        errors = list(self._errors())
        if errors:
            raise ValueError("; ".join(errors))

    def _errors(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            yield f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            yield f"temperature must be a finite number >= 0, got {self.temperature!r}"
        if not 0.0 < self.top_p <= 1.0:
            yield f"top_p must be in (0, 1], got {self.top_p!r}"
        if not isinstance(self.top_k, int) or self.top_k < -1:
            yield f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
        if not 0.0 <= self.min_p <= 1.0:
            yield f"min_p must be in [0, 1], got {self.min_p!r}"
        if not -2.0 <= self.presence_penalty <= 2.0:
            yield f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"
        if not -2.0 <= self.frequency_penalty <= 2.0:
            yield f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            yield f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            yield f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            yield f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"
        elif not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            yield "stop_token_ids must be non-negative integers"
        # the upper bound is the server's (--max-logprobs): the engine checks it
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs):
            yield f"logprobs must be an integer >= 0, got {self.logprobs!r}"
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs):
            yield f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            yield f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
        elif not all(isinstance(t, int) and t >= 0 and math.isfinite(b) and -100.0 <= b <= 100.0
                     for t, b in self.logit_bias):
            yield "logit_bias maps token ids (non-negative integers) to values in [-100, 100]"
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens:
            yield f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            yield f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
        if not all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
            yield "allowed_token_ids must be non-negative integers"
        if len(self.bad_words) > MAX_BAD_WORD_SEQUENCES:
            yield f"at most {MAX_BAD_WORD_SEQUENCES} bad_words, got {len(self.bad_words)}"
        elif not all(0 < len(word) <= MAX_BAD_WORD_TOKENS and all(isinstance(t, int) and t >= 0 for t in word)
                     for word in self.bad_words):
            yield f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} tokens (non-negative integers)"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def top_k_filters(self, vocab_size: int) -> bool:
        """top-k removes tokens from a vocabulary of this size (it is on and smaller than the vocabulary)."""
        return self.top_k_enabled and self.top_k < vocab_size

    @property
    def top_p_filters(self) -> bool:
        return self.top_p < 1.0

    @property
    def min_p_filters(self) -> bool:
        return self.min_p > 0.0


@dataclass(frozen=True)
class SpeculationParams:
    """Which proposer drafts for a request and how many tokens per step (K). method None: no speculation.
    `draft_pipelining`: let the drafter draft the next step while this one is verified; None: its own setting."""

    method: str | None = None
    num_speculative_tokens: int = 0
    draft_pipelining: bool | None = None
    # OpenAI's predicted output as token ids, drafted from by method "prediction" (prediction_proposer.py)
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: token ids in, sampling and speculation settings."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
