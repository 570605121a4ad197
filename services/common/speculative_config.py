"""`--speculative-config` (server default) and the per-request `speculative_config`, shaped like vLLM's."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.drafter_methods import EXTRACT_HIDDEN_STATES, TREE_METHODS, check_method


DEFAULT_EAGLE_TOPK = 4


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "ngram"  # a registered drafter method (services/common/drafter_methods.py) or "none"
    num_speculative_tokens: int = Field(5, ge=0, le=64)
    # Token trees (SGLang's speculative_num_draft_tokens): the drafter sends a tree of up to this many tokens, and
    # each step verifies them all in one forward (services/verifier/draft_trees.py). None: a chain of
    # num_speculative_tokens. Methods in TREE_METHODS only.
    num_draft_tokens: int | None = Field(None, ge=1, le=64)
    # eagle trees (SGLang's speculative_eagle_topk): children each expanded node gets, and nodes expanded per depth
    # (services/drafter/eagle_trees.py); None: DEFAULT_EAGLE_TOPK where num_draft_tokens asks for trees
    eagle_topk: int | None = Field(None, ge=1, le=16)
    # ngram (prompt lookup)
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    # draft_model / eagle: vLLM's `model` (the draft model) and `max_model_len` (its positions per sequence;
    # None: the model's whole context, as for the target); the rest are specserve's, named like vLLM's
    # draft_tensor_parallel_size: where the draft model runs and how many sequences keep a KV slot in it.
    # eagle without a model: the head that ships for the target (services/modeling/eagle_heads/)
    model: str | None = None
    max_model_len: int | None = Field(None, ge=2)
    draft_device: str = "auto"
    draft_dtype: str = "auto"
    draft_max_num_seqs: int = Field(16, ge=1)  # room for two verifiers at their default of 8
    # draft_model, eagle: draft the next step while the verifier verifies this one, on the guess that this draft
    # is accepted whole (services/drafter/draft_pipelining.py); each request may override it. None: where it
    # measured faster, i.e. a draft model with compute of its own (draft_pipelining.default_pipelining)
    draft_pipelining: bool | None = None
    # suffix decoding (Arctic Inference)
    suffix_decoding_max_tree_depth: int = Field(24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(10_000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)
    # extract_hidden_states: the folder each finished request's token ids and target hidden states go to
    output_dir: str | None = None

    @field_validator("method")
    @classmethod
    def _registered(cls, value: str) -> str:
        return check_method(value)

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"method {self.method!r} needs a 'model'")
        if self.num_draft_tokens is not None and self.method not in TREE_METHODS:
            raise ValueError(f"num_draft_tokens asks for token trees, which method {self.method!r} does not draft "
                             f"(methods that do: {', '.join(sorted(TREE_METHODS))})")
        if self.eagle_topk is not None and (self.method != "eagle" or self.num_draft_tokens is None):
            raise ValueError("eagle_topk shapes EAGLE's token trees: it needs method 'eagle' and num_draft_tokens")
        if self.method == EXTRACT_HIDDEN_STATES and not self.output_dir:
            raise ValueError(f"method {EXTRACT_HIDDEN_STATES!r} needs an 'output_dir' for its files")
        return self

    @property
    def enabled(self) -> bool:
        """A drafter proposes (extract_hidden_states serves without speculation)."""
        return self.method not in ("none", EXTRACT_HIDDEN_STATES) and self.num_speculative_tokens > 0

    @property
    def verify_width(self) -> int:
        """Draft tokens each row may have verified per step: a tree's nodes, or a chain's length."""
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_speculative_tokens

    @property
    def extract_dir(self) -> str | None:
        return self.output_dir if self.method == EXTRACT_HIDDEN_STATES else None

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig:
        """Parse the JSON of a --speculative-config flag; empty means no speculation."""
        if not text:
            return cls(method="none", num_speculative_tokens=0)
        try:
            return cls.model_validate(json.loads(text))
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON: {error}") from error
        except ValidationError as error:
            raise ValueError(f"invalid --speculative-config: {error}") from error
