"""Load a causal LM and its tokenizer from whatever `--model` names: folder, .gguf file, registered name, hub id.

One resolver (model_source.py) for every service keeps `--model` meaning the same thing in the verifier, in
model-based drafters (which must share a tokenizer) and in the gateway. Loading also decides early, and loudly,
when a model cannot be had: on machines without a hub connection a hub id must fail in seconds with a list of
what would work, never hang in download retries.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import torch

from services.common.device import resolve_device, resolve_dtype
from services.modeling.converted_cache import ensure_converted
from services.modeling.model_source import (
    ModelSource,
    ModelUnavailableError,
    remote_code_named,
    resolve_model_source,
)
from services.modeling.registry import registered_model_names

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for inference (eval mode, on `device`, in `dtype`) with its tokenizer."""

    model: torch.nn.Module
    tokenizer: Any
    model_id: str
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    load_seconds: float

    @property
    def eos_token_ids(self) -> set[int]:
        """Every end-of-sequence id the generation config, the model config and the tokenizer declare."""
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids


def _folder_weight_kwargs(folder: Path, allow_pickle: bool) -> dict[str, Any]:
    """Refuse pickled checkpoints unless asked: unpickling runs arbitrary code from the model files."""
    if any(folder.glob("*.safetensors")):
        return {"use_safetensors": True}
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        if allow_pickle:
            return {"use_safetensors": False}
        raise ValueError(
            f"{folder} holds only pickled weights ({', '.join(pickled[:3])}); loading them can run arbitrary "
            "code. Convert them to safetensors, or pass allow_pickle=True if you trust this folder"
        )
    raise FileNotFoundError(f"{folder} has no model weights (*.safetensors) and no .gguf file")


def _connect_target(endpoint: str) -> tuple[str, int] | None:
    """Host and port a hub request would first connect to: the proxy if one applies, else the endpoint."""
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return None
    scheme = parts.scheme or "https"
    target = (parts.hostname, parts.port or (443 if scheme == "https" else 80))
    proxy = getproxies().get(scheme)
    if proxy and not proxy_bypass(parts.hostname):
        proxy_parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if proxy_parts.hostname:
            target = (proxy_parts.hostname, proxy_parts.port or 80)
    return target


def hub_reachable(endpoint: str | None = None, timeout_s: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connect, bounded in time including DNS (which `socket` cannot time out on its own)."""
    if endpoint is None:
        from huggingface_hub import constants as hf_constants

        endpoint = hf_constants.ENDPOINT
    target = _connect_target(endpoint)
    if target is None:
        return False
    outcome: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(target, timeout=timeout_s):
                outcome.append(True)
        except OSError:
            outcome.append(False)

    worker = threading.Thread(target=probe, name="hub-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(outcome and outcome[0])


def _from_pretrained(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool, **extra: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    common = {"trust_remote_code": trust_remote_code, **source.pretrained_kwargs(), **extra}
    tokenizer_kwargs = {k: v for k, v in common.items() if k != "use_safetensors"}
    model_kwargs: dict[str, Any] = {}
    if source.gguf_file is not None:
        # transformers keeps GGUF weights packed when the `kernels` package is installed; the model runner
        # reads plain dense weights, so ask for them whatever happens to be installed
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    with remote_code_named(source.path):
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **common, **model_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source.path, **tokenizer_kwargs)
    return model, tokenizer


def _load_from_hub(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool, allow_pickle: bool):
    """The local HF cache first; the network only when the hub answers, so offline machines fail fast."""
    from huggingface_hub import constants as hf_constants

    weights = {} if allow_pickle else {"use_safetensors": True}
    try:
        return _from_pretrained(source, dtype, trust_remote_code, local_files_only=True, **weights)
    except OSError as exc:
        local_error = exc
    names = ", ".join(registered_model_names())
    why = None
    if hf_constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
    elif not hub_reachable(hf_constants.ENDPOINT):
        why = f"the Hugging Face Hub ({hf_constants.ENDPOINT}) is not reachable from here"
    if why is not None:
        raise ModelUnavailableError(
            f"model {source.path!r} is not a local folder, a .gguf file or a registered model, it is not in "
            f"the local Hugging Face cache, and {why}; registered models: {names}"
        ) from local_error
    logger.info("%s not in the local HF cache; downloading from %s", source.path, hf_constants.ENDPOINT)
    return _from_pretrained(source, dtype, trust_remote_code, **weights)


def converted_folder(source: ModelSource, trust_remote_code: bool = False) -> Path | None:
    """A registered model's GGUF converted once into a folder that loads in seconds (converted_cache.py)."""
    gguf_file = Path(source.path) / source.gguf_file
    return ensure_converted(
        gguf_file, lambda: _from_pretrained(source, torch.float32, trust_remote_code)
    )


def load_model(
    spec: str,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> LoadedModel:
    """Resolve `spec`, load model and tokenizer, move the model to the device in eval mode. A registered model
    loads from its converted folder (made at its first load), a .gguf file given by path from the file itself."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    source = resolve_model_source(spec, cache_dir)
    started = time.perf_counter()
    if source.kind == "hub":
        model, tokenizer = _load_from_hub(source, torch_dtype, trust_remote_code, allow_pickle)
    elif source.kind == "folder":
        weights = _folder_weight_kwargs(Path(source.path), allow_pickle)
        model, tokenizer = _from_pretrained(source, torch_dtype, trust_remote_code, **weights)
    elif source.kind == "registered" and (converted := converted_folder(source, trust_remote_code)) is not None:
        folder = ModelSource("folder", str(converted), source.model_id)
        model, tokenizer = _from_pretrained(folder, torch_dtype, trust_remote_code, use_safetensors=True)
    else:
        model, tokenizer = _from_pretrained(source, torch_dtype, trust_remote_code)
    # from_pretrained already chose the dtype; a blanket .to(dtype) would also cast float32-by-design buffers
    model = model.to(torch_device).eval()
    elapsed = time.perf_counter() - started
    logger.info(
        "loaded %s (%s) on %s as %s in %.1f s",
        source.model_id,
        source.kind,
        torch_device,
        torch_dtype,
        elapsed,
    )
    return LoadedModel(model, tokenizer, source.model_id, source, torch_device, torch_dtype, elapsed)
