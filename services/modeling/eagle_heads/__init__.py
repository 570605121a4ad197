"""EAGLE heads that ship with specserve, so that `{"method": "eagle"}` drafts without training a head first.

One folder per target (a registered model name), each with the head's weights (fp16 safetensors), its config,
its held-out evaluation and a model card saying how it was trained (`make eagle-head` reproduces it).
"""

from __future__ import annotations

from pathlib import Path

from services.modeling.registry import DEFAULT_MODEL

HEADS_DIR = Path(__file__).resolve().parent


def shipped_heads() -> dict[str, Path]:
    """Target model name -> the folder of the head that ships for it."""
    return {folder.name: folder for folder in sorted(HEADS_DIR.iterdir())
            if (folder / "eagle_config.json").is_file()}


def shipped_head(target: str | None = None) -> Path:
    """The shipped head for `target` (None: the default target); a ValueError that says what to do otherwise."""
    name = target or DEFAULT_MODEL
    heads = shipped_heads()
    if name not in heads:
        shipped = ", ".join(heads) or "none"
        raise ValueError(f"no EAGLE head ships for target {name!r} (shipped: {shipped}); train one with "
                         f"`specserve train-eagle --model {name}` and pass its folder as the speculative config's "
                         "'model'")
    return heads[name]
