"""A registered model's GGUF file converted once into a transformers folder beside it, so later loads are quick.

Why: transformers' GGUF path parses the whole file three times per load (config, tokenizer, weights: the 49,152
vocabulary strings of SmolLM2 through numpy memmaps each time) and rebuilds gguf's tensor-name map for every tensor.
SmolLM2-135M took 30 s to load that way on a 2-core CPU, at every start of a verifier, a model drafter or a test,
and again after every restart. The converted folder loads in about 2 s.

What the folder holds: the weights exactly as the GGUF path produces them (dequantized to float32; a quantized
file's values need float32 to be held exactly, and any dtype asked for later is cast from them as the GGUF path casts
them), as safetensors; config and generation config; the tokenizer with its chat template. Held equal to a direct
GGUF load (every tensor bit for bit, the config, the tokenizer's ids, template and fingerprint) by
tests/unit/test_converted_cache.py.

Only registered models are converted: they live in specserve's own cache. A user's own .gguf file's folder is not
ours to write into. A cache that cannot be written (a read-only volume) loads from the GGUF file each time.

No torch here: the gateway reads the folder's tokenizer, and its install set has no torch.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from services.modeling.fetch import exclusive_lock, marker_path

logger = logging.getLogger(__name__)

FOLDER_SUFFIX = ".converted"
COMPLETE_MARKER = "specserve-converted.json"  # written last: a folder without it is not used
FORMAT_VERSION = 1  # bump when what the folder holds changes; older folders are then converted again

LoadFromGguf = Callable[[], tuple[Any, Any]]
"""Loads (model in float32 on the CPU, tokenizer) from the GGUF file."""


def converted_folder(gguf_file: Path) -> Path:
    return gguf_file.with_name(gguf_file.name + FOLDER_SUFFIX)


def _expected_marker(gguf_file: Path) -> dict[str, Any]:
    """What a folder was made from: the GGUF file (name, size, the sha256 that fetch verified) and the transformers
    version that read it (another version may dequantize or template differently: then it is converted again)."""
    try:
        sha256 = marker_path(gguf_file).read_text().strip()
    except OSError:
        sha256 = None
    return {"format": FORMAT_VERSION, "gguf_file": gguf_file.name, "gguf_bytes": gguf_file.stat().st_size,
            "gguf_sha256": sha256, "transformers": version("transformers")}


def complete_folder(gguf_file: Path) -> Path | None:
    """The converted folder of `gguf_file` when it is complete and made from this very file, else None."""
    folder = converted_folder(gguf_file)
    try:
        return folder if json.loads((folder / COMPLETE_MARKER).read_text()) == _expected_marker(gguf_file) else None
    except (OSError, ValueError):
        return None


def ensure_converted(gguf_file: Path, load_from_gguf: LoadFromGguf) -> Path | None:
    """The complete converted folder, converting now if there is none; None when the cache cannot be written
    (the caller then loads from the GGUF file). Safe with several processes starting at once: one converts, the
    others wait on the cache folder's lock and use its result."""
    folder = complete_folder(gguf_file)
    if folder is not None:
        return folder
    try:
        with exclusive_lock(gguf_file.parent / ".lock"):
            folder = complete_folder(gguf_file)
            if folder is None:
                folder = _convert(gguf_file, load_from_gguf)
    except OSError as error:
        logger.warning("cannot write the converted copy of %s (%s); loading from the GGUF file, which is slower",
                       gguf_file, error)
        return None
    return folder


def _convert(gguf_file: Path, load_from_gguf: LoadFromGguf) -> Path:
    folder = converted_folder(gguf_file)
    logger.info("converting %s once into %s (later loads read that folder)", gguf_file.name, folder)
    model, tokenizer = load_from_gguf()
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier attempt
    partial = Path(tempfile.mkdtemp(dir=gguf_file.parent, prefix=folder.name + ".partial-"))
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        (partial / COMPLETE_MARKER).write_text(json.dumps(_expected_marker(gguf_file)))
        for file in partial.iterdir():  # the cache may be shared by several users; some writers make files private
            file.chmod(0o644)
        partial.chmod(0o755)
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
