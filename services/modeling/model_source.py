"""What `--model` names: a model folder, a .gguf file (or a folder holding just one), a registered name, or a
hub id; resolved the same way by every service.

Why a module of its own, apart from loading.py: the gateway needs only the tokenizer, and its install set has no
torch; this resolver imports nothing heavier than the standard library and the model registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.modeling.fetch import FetchError, default_cache_dir, fetch_registered_model
from services.modeling.registry import find_registered_model, registered_model_names

SourceKind = Literal["folder", "gguf", "registered", "hub"]


class ModelUnavailableError(RuntimeError):
    """The model `--model` names is neither on disk nor fetchable here: a start-up failure whose message says
    what to do (the CLI prints it and exits 1; a gateway still learning its model reports it on /health and as
    503s). Never a traceback, never a 500."""


@contextmanager
def remote_code_named(path: str) -> Iterator[None]:
    """transformers refuses a model whose folder ships Python code unless `trust_remote_code=True` (a ValueError
    naming that argument): say it as this command line does, and as a model that cannot be had here."""
    try:
        yield
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise ModelUnavailableError(f"{path} ships Python code for its model or tokenizer, which runs only with "
                                    "--trust-remote-code (vLLM's flag; `specserve serve`, `verifier`, `gateway` and "
                                    "`generate` take it, a draft model does not): pass it if you trust that code"
                                    ) from error


def registered_model_unavailable(name: str, folder: Path, error: BaseException) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"model {name!r} is not in the cache folder {folder} and could not be fetched into it ({error}). "
        f"Run `specserve fetch {name}` where the package index is reachable (with SPECSERVE_CACHE_DIR set to the "
        f"folder this service reads, or copy the model folder there), or set SPECSERVE_CACHE_DIR to a folder "
        f"that holds it, or pass --model a local model folder or .gguf file."
    )


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `path` is a folder (for gguf kinds: the folder holding `gguf_file`) or,
    for `hub`, the repo id; `model_id` is the name reported to users and metrics."""

    kind: SourceKind
    path: str
    model_id: str
    gguf_file: str | None = None

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Arguments that `from_pretrained(self.path, ...)` needs for this kind of source."""
        return {"gguf_file": self.gguf_file} if self.gguf_file is not None else {}


def _looks_like_path(spec: str) -> bool:
    """A missing local path should say 'not found', not be sent to the hub as a repo id."""
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def resolve_model_source(spec: str, cache_dir: Path | None = None, *, fetch: bool = True) -> ModelSource:
    """Decide what `spec` names; a registered name is fetched into `cache_dir` unless `fetch` is False."""
    text = spec.strip()
    path = Path(text).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ModelSource("gguf", str(path.resolve()), ggufs[0].name, gguf_file=ggufs[0].name)
        return ModelSource("folder", str(path.resolve()), path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {text!r} is not a .gguf file; pass a .gguf file or a model folder")
        path = path.resolve()
        return ModelSource("gguf", str(path.parent), path.name, gguf_file=path.name)

    registered = find_registered_model(text)
    if registered is not None:
        if fetch:
            try:
                file = fetch_registered_model(registered, cache_dir)
            except (FetchError, OSError) as error:  # no index, a read-only or full cache folder
                raise registered_model_unavailable(registered.name, Path(cache_dir or default_cache_dir()),
                                                   error) from error
        else:
            file = Path(cache_dir or default_cache_dir()) / registered.name / registered.filename
        return ModelSource("registered", str(file.parent), registered.name, gguf_file=file.name)

    if _looks_like_path(text):
        raise ModelUnavailableError(
            f"model path {text!r} does not exist; registered models: {', '.join(registered_model_names())}"
        )
    return ModelSource("hub", text, text)
