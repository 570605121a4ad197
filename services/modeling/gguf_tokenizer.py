"""A GGUF file's tokenizer, built without torch.

Why not `AutoTokenizer.from_pretrained(folder, gguf_file=...)`: transformers (5.x) reads GGUF metadata through a
module that imports torch at its top, and the gateway's install set has no torch (its image is small because of
that). The metadata is read here with the `gguf` package (numpy only), then handed to transformers' own GGUF
tokenizer conversion (`convert_gguf_tokenizer`, torch-free), so the vocabulary, merges, special tokens and chat
template are exactly what transformers builds; tests/unit/test_gguf_tokenizer.py holds the two equal on every
registered model (ids, decoding, the rendered chat).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# transformers' names: GGUF key (after "tokenizer.") -> tokenizer field, for the two groups it reads.
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _tokenizer_metadata(path: Path) -> tuple[str, dict[str, Any]]:
    """(architecture, every `tokenizer.*` key's value) of a GGUF file, without reading its tensors' data."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    architecture = fields["general.architecture"].contents()
    return architecture, {key: field.contents() for key, field in fields.items() if key.startswith("tokenizer.")}


def load_gguf_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer (`TokenizersBackend`) equal to the one transformers builds for this file."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    architecture, metadata = _tokenizer_metadata(Path(path))
    groups = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # as transformers: llama.cpp adds BOS to such vocabularies
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)
