"""`--speculative-config` (server default) and the per-request `speculative_config`, shaped like vLLM's."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.drafter_methods import (
    BUILTIN_METHODS,
    EXTRACT_HIDDEN_STATES,
    check_method,
    method_options,
)
from services.common.method_options import MAX_SPECULATIVE_TOKENS, MethodOptions, TreeOptions


class SpeculativeConfig(BaseModel):
    """The fields every method shares; a method's own options (method_options.py) sit beside them in the same
    flat object and are checked against the method's options class (the `options` property parses them)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    method: str = "ngram"  # a registered drafter method (services/common/drafter_methods.py) or "none"
    # The depth of a draft: a chain's length, or a tree's deepest path (its tokens: the method's num_draft_tokens)
    num_speculative_tokens: int = Field(5, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # draft_model / eagle: vLLM's `model` (the draft model) and `max_model_len` (its positions per sequence;
    # None: the model's whole context, as for the target); the rest are specserve's, named like vLLM's
    # draft_tensor_parallel_size: where the draft model runs and how many sequences keep a KV slot in it.
    # eagle without a model: the head that ships for the target (services/modeling/eagle_heads/)
    model: str | None = None
    max_model_len: int | None = Field(None, ge=2)
    draft_device: str = "auto"
    draft_dtype: str = "auto"
    draft_max_num_seqs: int = Field(16, ge=1)  # room for two verifiers at their default of 8
    # vLLM's: on an accelerator the draft model's forwards and an EAGLE head's drafting run eagerly, no graph
    # captured (services/modeling/step_graphs.py, services/drafter/eagle_head_graphs.py)
    enforce_eager: bool = False
    # draft_model, eagle: draft the next step while the verifier verifies this one, on the guess that this draft
    # is accepted whole (services/drafter/draft_pipelining.py); each request may override it. None: where it
    # measured faster, i.e. a draft model with compute of its own (draft_pipelining.default_pipelining)
    draft_pipelining: bool | None = None
    # extract_hidden_states: the folder each finished request's token ids and target hidden states go to
    output_dir: str | None = None

    @field_validator("method")
    @classmethod
    def _registered(cls, value: str) -> str:
        return check_method(value)

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError(f"method {self.method!r} needs a 'model'")
        if self.method == EXTRACT_HIDDEN_STATES and not self.output_dir:
            raise ValueError(f"method {EXTRACT_HIDDEN_STATES!r} needs an 'output_dir' for its files")
        self.options  # noqa: B018 - the method's own fields, refused here rather than when a proposer is built
        return self

    @property
    def options(self) -> MethodOptions:
        """The method's own options (its class in the registry), from the fields this class does not define."""
        kind = method_options(self.method)
        given = dict(self.model_extra or {})
        unknown = sorted(set(given) - set(kind.model_fields))
        if "num_draft_tokens" in unknown:
            trees = sorted(name for name, entry in BUILTIN_METHODS.items() if issubclass(entry.options, TreeOptions))
            raise ValueError(f"num_draft_tokens asks for token trees, which method {self.method!r} does not draft "
                             f"(methods that do: {', '.join(trees)})")
        if unknown:
            own = f"its options: {', '.join(kind.model_fields)}" if kind.model_fields else "it has no options"
            raise ValueError(f"{', '.join(unknown)}: not an option of method {self.method!r} ({own})")
        try:
            return kind.model_validate(given)
        except ValidationError as error:
            raise ValueError("; ".join(_describe(e) for e in error.errors())) from None

    @property
    def tree_tokens(self) -> int | None:
        """The tokens a tree may hold (the method's num_draft_tokens); None: the method drafts chains."""
        options = self.options
        return options.num_draft_tokens if isinstance(options, TreeOptions) else None

    @property
    def sends_trees(self) -> bool:
        return self.tree_tokens is not None

    @property
    def enabled(self) -> bool:
        """A drafter proposes (extract_hidden_states serves without speculation)."""
        return self.method not in ("none", EXTRACT_HIDDEN_STATES) and self.num_speculative_tokens > 0

    @property
    def verify_width(self) -> int:
        """Draft tokens each row may have verified per step: a tree's nodes, or a chain's length."""
        tree_tokens = self.tree_tokens
        return self.num_speculative_tokens if tree_tokens is None else tree_tokens

    @property
    def extract_dir(self) -> str | None:
        return self.output_dir if self.method == EXTRACT_HIDDEN_STATES else None

    @classmethod
    def parse(cls, text: str | None, overrides: dict | None = None) -> SpeculativeConfig:
        """Parse the JSON of a --speculative-config flag; empty means no speculation (unless `overrides` name a
        method). `overrides` (single fields set by flags, e.g. the drafter's --method) replace the JSON's before
        anything is checked: the options given are checked against the method that is finally used."""
        if not text and not overrides:
            return cls(method="none", num_speculative_tokens=0)
        try:
            given = json.loads(text) if text else {}
            if not isinstance(given, dict):
                raise ValueError(f"--speculative-config must be a JSON object, got {text}")
            return cls.model_validate({**given, **(overrides or {})})
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON: {error}") from error
        except ValidationError as error:
            raise ValueError(f"invalid --speculative-config: {error}") from error


def _describe(error: dict) -> str:
    """One of a method options class's validation errors, as the config's own would read."""
    message = error["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message
