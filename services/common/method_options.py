"""Each drafter method's own options: the fields of a speculative config beyond the ones every method shares.

Why per method: one flat config that refuses unknown fields left a plug-in method no way to add an option, and let
an option of one method ride along silently with another. The config stays one flat JSON object, as vLLM's and
SGLang's are (`{"method": "ngram", "prompt_lookup_max": 3}`); the registry (drafter_methods.py) names each
method's options class, and the config validates the fields it does not know itself against that class, so a
field no method option names is refused with the method's own options listed.

The built-in methods' classes live here, beside the registry, so that a verifier or a launcher can check a config
without importing drafter code; a plug-in method declares its class as OPTIONS in its own module.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The one limit on K, in every process that checks one: a chain's length, or the tokens a tree may hold.
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_EAGLE_TOPK = 4


class MethodOptions(BaseModel):
    """A method without options of its own (draft_model, and a plug-in that declares no OPTIONS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TreeOptions(MethodOptions):
    """The options of a method that can send token trees (Draft.parents)."""

    # SGLang's speculative_num_draft_tokens: the drafter sends a tree of up to this many tokens, each path at most
    # num_speculative_tokens deep, and each step verifies them all in one forward (services/verifier/
    # draft_trees.py). None: a chain of num_speculative_tokens.
    num_draft_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)


class NgramOptions(TreeOptions):
    """Prompt lookup: the n-gram sizes tried, longest first (vLLM's names); with num_draft_tokens, the
    continuations of its several matches as a token tree."""

    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> NgramOptions:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class SuffixOptions(TreeOptions):
    """Suffix decoding (Arctic Inference; vLLM's names)."""

    suffix_decoding_max_tree_depth: int = Field(24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(10_000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)


class EagleOptions(TreeOptions):
    # SGLang's speculative_eagle_topk: children each expanded node gets, and nodes expanded per depth
    # (services/drafter/eagle_trees.py); None: DEFAULT_EAGLE_TOPK where num_draft_tokens asks for trees
    eagle_topk: int | None = Field(None, ge=1, le=16)
    # the target model (a --model spec) whose embedding and LM head the head shares, for a published head whose
    # config does not name one (services/modeling/eagle_head_files.py); None: the head's own `target`
    target_model: str | None = None
    # With trees, a sampled request's tree is drawn from the head at the request's temperature and sent with q:
    # the verifier accepts it by multi-draft rejection sampling (services/verifier/tree_rejection.py), more often
    # than the deterministic rule when the head is close to the target, but a seeded request's output then depends
    # on the drafts (with deterministic trees it equals speculation off's). Greedy requests are unaffected.
    eagle_sampled_trees: bool = False

    @model_validator(mode="after")
    def _trees_only(self) -> EagleOptions:
        for name in ("eagle_topk", "eagle_sampled_trees"):
            if getattr(self, name) not in (None, False) and self.num_draft_tokens is None:
                raise ValueError(f"{name} shapes EAGLE's token trees: it needs num_draft_tokens")
        return self

    @property
    def tree_topk(self) -> int:
        return self.eagle_topk or DEFAULT_EAGLE_TOPK
