"""EAGLE heads that ship with specserve, so that `{"method": "eagle"}` drafts without training a head first.

One folder per target (a registered model name), each with the head's weights (fp16 safetensors), its config,
its held-out evaluation and a model card saying how it was trained (`make eagle-head` reproduces it). Where an
EAGLE-3 head ships too (`{"method": "eagle3"}`), it is in the target folder's `eagle3/`, in the speculators layout
vLLM loads (`make eagle3-head` reproduces it).
"""

from __future__ import annotations

from pathlib import Path

from services.modeling.registry import DEFAULT_MODEL

HEADS_DIR = Path(__file__).resolve().parent
EAGLE3_FOLDER = "eagle3"


def shipped_heads() -> dict[str, Path]:
    """Target model name -> the folder of the head that ships for it."""
    return {folder.name: folder for folder in sorted(HEADS_DIR.iterdir())
            if (folder / "eagle_config.json").is_file()}


def shipped_head(target: str | None = None, method: str = "eagle") -> Path:
    """The shipped head of `method` (eagle or eagle3) for `target` (None: the default target); a ValueError that
    says what to do otherwise."""
    name = target or DEFAULT_MODEL
    if method == "eagle3":  # looked up among the shipped targets' folders only (a --model may be any path)
        eagle3 = {t: folder / EAGLE3_FOLDER for t, folder in shipped_heads().items()
                  if (folder / EAGLE3_FOLDER / "config.json").is_file()}
        if name not in eagle3:
            shipped = ", ".join(eagle3)
            raise ValueError(f"no EAGLE-3 head ships for target {name!r} (shipped: {shipped or 'none'}); train one "
                             f"with `specserve train-eagle --eagle3 --model {name}` and pass its folder as the "
                             "speculative config's 'model'")
        return eagle3[name]
    heads = shipped_heads()
    if name not in heads:
        shipped = ", ".join(heads) or "none"
        raise ValueError(f"no EAGLE head ships for target {name!r} (shipped: {shipped}); train one with "
                         f"`specserve train-eagle --model {name}` and pass its folder as the speculative config's "
                         "'model'")
    return heads[name]
