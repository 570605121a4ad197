"""Loading the target's tokenizer and turning requests into prompt token ids.

The gateway tokenizes (and applies the chat template) so the verifier's engine only ever sees ids; it must use
exactly the tokenizer the verifier's model was saved with, hence the same `--model` spec resolution. Only
transformers' tokenizer classes are used (a GGUF file's tokenizer is read without its weights): the gateway's
install set has no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.modeling.converted_cache import complete_folder
from services.modeling.gguf_tokenizer import load_gguf_tokenizer
from services.modeling.model_source import ModelUnavailableError, remote_code_named, resolve_model_source


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer `spec` names (fetching a registered model that is not in the cache yet); a model that
    cannot be had raises ModelUnavailableError saying why and what to do. trust_remote_code: vLLM's flag, run the
    Python code a tokenizer's folder ships (without it, such a tokenizer raises what transformers says)."""
    from transformers import AutoTokenizer

    source = resolve_model_source(spec)
    converted = complete_folder(Path(source.path) / source.gguf_file) if source.kind == "registered" else None
    try:
        if converted is not None:  # a verifier converted this model already: its folder loads in a fraction
            return AutoTokenizer.from_pretrained(converted)
        if source.gguf_file is not None:  # transformers' own GGUF path imports torch
            return load_gguf_tokenizer(Path(source.path) / source.gguf_file)
        with remote_code_named(source.path):
            return AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code,
                                                 **source.pretrained_kwargs())
    except OSError as error:  # a hub id without a reachable hub, a folder without tokenizer files
        raise ModelUnavailableError(f"the tokenizer of model {spec!r} could not be loaded: {error}") from error


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a file holding a Jinja chat template, or the template itself; checked
    here, at start-up, so that a typo in a path or a template fails the start and not every chat request."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(text)  # transformers renders chat templates in this environment
    except TemplateSyntaxError as error:
        raise ValueError(f"chat_template is not a valid Jinja template: {error} (line {error.lineno})") from error
    return text


def with_chat_template(tokenizer: Any, template: str | None) -> Any:
    """The tokenizer rendering chats with `template` in place of the model's own (None: unchanged). A copy: the
    tokenizer object given may be shared."""
    if template is None or tokenizer is None:
        return tokenizer
    import copy

    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def encode_prompt(tokenizer: Any, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render with the model's chat template, then tokenize without adding special tokens again (the template
    already wrote BOS where the model wants one; `add_special_tokens`, vLLM's option, adds them anyway). A
    template may refuse a conversation (`raise_exception`, e.g. "roles must alternate"): that is the request's
    fault, a ValueError like the rest. `template_kwargs`: more variables for the template (vLLM's
    chat_template_kwargs)."""
    from jinja2.exceptions import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             tokenize=False, **(template_kwargs or {}))
    except TemplateError as exc:
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def make_decode(tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
    """Decoding used for output text: by default special tokens (eos, stop ids) are not text (vLLM's
    skip_special_tokens). spaces_between_special_tokens is the tokenizer's own option: a slow (Python) tokenizer
    applies it, a fast one joins special tokens as its decoder does whatever it says, as in vLLM.

    A fast tokenizer whose class decodes as transformers' own does, without the clean-up of spaces, is called
    through its Rust tokenizer directly: that is the whole of what transformers' decode does for it, and its
    argument conversions were two thirds of the time of a call (3.7 against 1.1 us for six ids, 2-core EPYC),
    paid twice a step for every choice (detokenizer.py)."""
    backend = _plain_fast_backend(tokenizer)
    if backend is not None:
        def decode_fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return decode_fast

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)
    return decode


def _plain_fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` whose decode is exactly `tokenizer.decode`'s, or None: a fast tokenizer of
    transformers' TokenizersBackend class or a subclass that overrides neither decode nor _decode, with the
    clean-up of tokenization spaces off."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode is used
        return None
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
             and cls._decode is TokenizersBackend._decode
             and not getattr(tokenizer, "clean_up_tokenization_spaces", True))
    return tokenizer.backend_tokenizer if plain else None


def decode_prompt(tokenizer: Any, ids: list[int]) -> str:
    """A token-id prompt as text, special tokens included: echo returns the prompt as sent, and an id the client
    put there is part of it."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def added_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the tokenizer's added token spelled exactly `text` (None: it has none, e.g. Qwen2.5's
    `<tool_call>` is one, SmolLM2's is not)."""
    added = getattr(tokenizer, "get_added_vocab", None)
    return None if added is None else added().get(text)
