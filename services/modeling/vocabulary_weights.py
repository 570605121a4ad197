"""A target model's token embedding and LM head alone, read from its checkpoint without building the model.

An EAGLE drafter reads tokens through the target's embedding and (EAGLE-1) scores them with the target's LM head;
nothing else of the target. It loaded the whole target for them: on an H100 the drafter spent 28.6 s loading
SmolLM2 whole (issue 29), and a drafter placed on the verifier's GPU held, while loading, a second copy of every
layer of a target that may fill much of that GPU already (the mission's "weights twice in memory"). Here the
target's architecture is built on the meta device (no memory), which names the two modules' tensors for any
architecture transformers knows, and only those tensors are read from the safetensors files and put on the device.

Plain `nn.Embedding` and bias-free `nn.Linear` modules only, from safetensors folders (a user's folder or a
registered model's converted one): a module of another kind may compute more than its weight says (Gemma's scaled
embedding keeps its scale in a buffer), and other sources (a .gguf file given by path, a hub id) are not laid out
by tensor name. Those load the whole model as before (`load_model`), then keep these two modules.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.common.device import resolve_device, resolve_dtype
from services.modeling.loading import converted_folder, load_model
from services.modeling.model_source import resolve_model_source

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, eq=False)
class VocabularyWeights:
    """The target's embedding and LM head on `device` in `dtype`, with its config and tokenizer."""

    embedding: nn.Module
    lm_head: nn.Module
    config: Any  # the target's transformers config
    tokenizer: Any
    load_seconds: float
    whole_model_loaded: bool  # True where the source needed the whole model loaded (see the module docstring)


def load_vocabulary_weights(spec: str, device: str | torch.device = "auto",
                            dtype: str | torch.dtype = "auto") -> VocabularyWeights:
    """The embedding and LM head of the model `spec` names (as `--model` does), read alone where the source
    allows it, else from the whole model."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    started = time.perf_counter()
    folder = _safetensors_folder(spec)
    parts = _read_parts(folder, torch_device, torch_dtype) if folder is not None else None
    if parts is None:
        loaded = load_model(spec, device=torch_device, dtype=torch_dtype)
        model = loaded.model
        return VocabularyWeights(model.get_input_embeddings(), model.get_output_embeddings(), model.config,
                                 loaded.tokenizer, time.perf_counter() - started, whole_model_loaded=True)
    from transformers import AutoTokenizer

    embedding, lm_head, config = parts
    tokenizer = AutoTokenizer.from_pretrained(folder)
    seconds = time.perf_counter() - started
    logger.info("read %s's embedding and LM head alone (%s, %s) in %.1f s", spec, torch_device, torch_dtype, seconds)
    return VocabularyWeights(embedding, lm_head, config, tokenizer, seconds, whole_model_loaded=False)


def _safetensors_folder(spec: str) -> Path | None:
    """The folder of safetensors the model loads from, or None where it loads otherwise."""
    source = resolve_model_source(spec)
    if source.kind == "folder" and source.gguf_file is None:
        folder = Path(source.path)
    elif source.kind == "registered":
        folder = converted_folder(source)
    else:
        return None
    return folder if folder is not None and any(folder.glob("*.safetensors")) else None


def _read_parts(folder: Path, device: torch.device, dtype: torch.dtype):
    """(embedding, LM head, config) read from the folder's safetensors; None where the modules are not the plain
    kinds this reads (the caller then loads the whole model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    embedding, lm_head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    if type(embedding) is not nn.Embedding or type(lm_head) is not nn.Linear or lm_head.bias is not None:
        logger.info("%s: embedding %s, LM head %s: loading the whole model for them", folder,
                    type(embedding).__name__, type(lm_head).__name__)
        return None
    names = {module: name for name, module in skeleton.named_modules()}
    embedding_name, head_name = f"{names[embedding]}.weight", f"{names[lm_head]}.weight"
    tensors = _read_tensors(folder, [embedding_name, head_name])
    if embedding_name not in tensors:
        raise ValueError(f"{folder}'s weights have no {embedding_name}")
    tied = lm_head.weight is embedding.weight  # transformers ties them on building the model, as on loading it
    if head_name not in tensors and not tied:
        raise ValueError(f"{folder}'s weights have no {head_name} and its config does not tie it to the embedding")
    embed_weight = tensors[embedding_name].to(device=device, dtype=dtype)
    new_embedding = nn.Embedding.from_pretrained(embed_weight, freeze=True, padding_idx=embedding.padding_idx)
    new_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False, device="meta")
    new_head.weight = new_embedding.weight if tied else nn.Parameter(
        tensors[head_name].to(device=device, dtype=dtype), requires_grad=False)
    return new_embedding.eval(), new_head.eval(), config


def _read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors present in the folder's safetensors files (sharded through their index, or not)."""
    from safetensors import safe_open

    index = folder / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / weight_map[name] for name in names if name in weight_map}
    else:
        files = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                files.update({name: path for name in names if name in f.keys() and name not in files})
    tensors = {}
    for name, path in files.items():
        with safe_open(path, "pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors
