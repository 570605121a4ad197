"""A target model's token embedding and LM head alone, read from its checkpoint without building the model.

An EAGLE drafter reads tokens through the target's embedding and (EAGLE-1) scores them with the target's LM head;
nothing else of the target. It loaded the whole target for them, so a drafter placed on the verifier's GPU held,
while loading, a second copy of every layer of a target that may fill much of that GPU already (the mission's "weights
twice in memory"; issue 29). Here the target's architecture is built on the meta device (no memory), which names the
two modules' tensors for any architecture transformers knows, and only those tensors are read from the safetensors
files and put on the device. For SmolLM2 on CPU the EAGLE drafter's peak memory went 667 -> 465 MB.

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
    """The target's embedding and LM head on `device` in `dtype` (None: not asked for), its config and tokenizer."""

    embedding: nn.Module | None
    lm_head: nn.Module | None
    config: Any  # the target's transformers config
    tokenizer: Any
    whole_model_loaded: bool  # True where the source needed the whole model loaded (see the module docstring)


def load_vocabulary_weights(spec: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto", *,
                            embedding: bool = True, lm_head: bool = True) -> VocabularyWeights:
    """The embedding and LM head of the model `spec` names (as `--model` does), read alone where the source
    allows it, else from the whole model. `embedding` / `lm_head` False: that one is not read (an EAGLE-3 head
    scores with its own LM head; some checkpoints ship their own embedding too), which for a large untied target
    spares a vocabulary x hidden matrix (1 GB for Llama 3 8B in bf16)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    started = time.perf_counter()
    folder = _safetensors_folder(spec)
    parts = _read_parts(folder, torch_device, torch_dtype, embedding, lm_head) if folder is not None else None
    if parts is None:
        loaded = load_model(spec, device=torch_device, dtype=torch_dtype)
        model = loaded.model
        return VocabularyWeights(model.get_input_embeddings() if embedding else None,
                                 model.get_output_embeddings() if lm_head else None, model.config,
                                 loaded.tokenizer, whole_model_loaded=True)
    from transformers import AutoTokenizer

    read_embedding, read_head, config = parts
    tokenizer = AutoTokenizer.from_pretrained(folder)
    logger.info("read %s's vocabulary weights alone (embedding: %s, LM head: %s) on %s as %s in %.1f s", spec,
                embedding, lm_head, torch_device, torch_dtype, time.perf_counter() - started)
    return VocabularyWeights(read_embedding, read_head, config, tokenizer, whole_model_loaded=False)


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


def _read_parts(folder: Path, device: torch.device, dtype: torch.dtype, embedding: bool, lm_head: bool):
    """(embedding, LM head, config) read from the folder's safetensors, each None where not asked for; None where
    the modules are not the plain kinds this reads (the caller then loads the whole model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    plain_embedding, plain_head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    if (type(plain_embedding) is not nn.Embedding or type(plain_head) is not nn.Linear
            or plain_head.bias is not None):
        logger.info("%s: embedding %s, LM head %s: loading the whole model for them", folder,
                    type(plain_embedding).__name__, type(plain_head).__name__)
        return None
    names = {module: name for name, module in skeleton.named_modules()}
    embedding_name, head_name = f"{names[plain_embedding]}.weight", f"{names[plain_head]}.weight"
    tied = plain_head.weight is plain_embedding.weight  # transformers ties them on building the model, as on loading
    reads_embedding = embedding or (lm_head and tied)
    wanted = [embedding_name] * reads_embedding + [head_name] * (lm_head and not tied)
    tensors = _read_tensors(folder, wanted)
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise ValueError(f"{folder}'s weights have no {', '.join(missing)}")
    new_embedding = nn.Embedding.from_pretrained(
        tensors[embedding_name].to(device=device, dtype=dtype), freeze=True,
        padding_idx=plain_embedding.padding_idx).eval() if reads_embedding else None
    new_head = None
    if lm_head:
        new_head = nn.Linear(plain_head.in_features, plain_head.out_features, bias=False, device="meta").eval()
        new_head.weight = new_embedding.weight if tied else nn.Parameter(
            tensors[head_name].to(device=device, dtype=dtype), requires_grad=False)
    return new_embedding if embedding else None, new_head, config


def _read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors present in the folder's safetensors files (only the shards holding them, where an index
    says which), each file opened once."""
    from safetensors import safe_open

    index = folder / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        paths = sorted({folder / weight_map[name] for name in names if name in weight_map})
    else:
        paths = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(path, "pt") as f:
            for name in set(names).intersection(f.keys()).difference(tensors):
                tensors[name] = f.get_tensor(name)
    return tensors
