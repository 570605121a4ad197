"""vLLM's --generation-config: the sampling defaults a model's generation_config.json sets (temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as the default max_tokens) apply to the requests that leave
those fields out, as `vllm serve` does by default ("auto"). "vllm" keeps OpenAI's defaults (temperature 1, no
top-p, top-k or min-p, no repetition penalty); a folder reads that folder's generation_config.json instead.

Why: a model whose authors ship, say, temperature 0.7 and top_p 0.8 answers differently without them, and a user
moving from vLLM would see other output for the same requests. A request's own values always win, an explicit 0
or 1 included. The file is read once, when the gateway learns its model, and a value outside what a request may
send fails the start (or leaves the gateway not ready) naming the file and the field."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from services.gateway.schemas import SamplingFields
from services.modeling.converted_cache import complete_folder
from services.modeling.model_source import resolve_model_source

logger = logging.getLogger("specserve.gateway")

# The fields a generation_config.json may default, each checked as a request's own value is (schemas.SamplingFields:
# its type, strictly, and its bounds), so that a default is never what no request could send
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_REQUEST_FIELD = {name: TypeAdapter(Annotated[SamplingFields.model_fields[name].annotation,
                                              SamplingFields.model_fields[name]], config=ConfigDict(strict=True))
                  for name in SAMPLING_FIELDS}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)  # field -> value, for requests without it
    max_tokens: int | None = None  # max_new_tokens: for requests that give no max_tokens

    def apply(self, req: Any) -> Any:
        """The request with each default it leaves out (a copy; the request itself where it sets them all)."""
        missing = {name: value for name, value in self.sampling.items() if getattr(req, name) is None}
        return req.model_copy(update=missing) if missing else req

    def default_max_tokens(self, room: int) -> int:
        """A request without max_tokens: max_new_tokens, within the `room` its prompt leaves (as vLLM caps it)."""
        return room if self.max_tokens is None else min(self.max_tokens, room)


def model_folder(spec: str) -> Path | None:
    """Where `spec`'s generation_config.json would be: a folder model's folder, a registered model's converted
    folder where a verifier has made it; None for a .gguf file or a hub id (their defaults are not read)."""
    source = resolve_model_source(spec)
    if source.kind == "folder":
        return Path(source.path)
    if source.kind == "registered" and source.gguf_file is not None:
        return complete_folder(Path(source.path) / source.gguf_file)
    return None


def read_generation_defaults(setting: str, model_spec: str | None) -> GenerationDefaults:
    """The defaults `setting` ("auto", "vllm" or a folder) gives the model `model_spec` (None: not known)."""
    if setting == "vllm":
        return GenerationDefaults()
    folder = Path(setting) if setting != "auto" else model_folder(model_spec) if model_spec else None
    path = folder / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} could not be read as JSON: {error}") from error
    sampling = {name: _checked(path, name, config[name]) for name in SAMPLING_FIELDS if config.get(name) is not None}
    max_new = config.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise ValueError(f"{path}: max_new_tokens must be a positive integer, got {max_new!r}")
    defaults = GenerationDefaults(sampling, max_new)
    if sampling or max_new is not None:
        logger.info("default sampling of requests that leave it out, from %s (--generation-config vllm: OpenAI's): "
                    "%s%s", path, sampling, f", max_tokens {max_new}" if max_new is not None else "")
    return defaults


def _checked(path: Path, name: str, value: Any) -> float | int:
    if isinstance(value, bool):
        raise ValueError(f"{path}: {name} must be a number, got {value!r}")
    try:
        return _REQUEST_FIELD[name].validate_python(value)
    except ValidationError as error:
        problem = error.errors()[0]
        if problem["type"].endswith(("_type", "_parsing")):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}") from None
        raise ValueError(f"{path}: {name} {value} is outside what a request may send ({problem['msg']})") from None
