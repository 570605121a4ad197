"""Reading an EAGLE head from a folder, in the layouts users have: specserve's own, and the published ones.

- specserve's EAGLE-1 heads: `eagle_config.json` + `model.safetensors` (EagleHead.save).
- speculators (what vLLM loads, e.g. RedHatAI's `*-speculator.eagle3`): `config.json` with
  `"speculators_model_type": "eagle3"`, the layer's fields under `transformer_layer_config`, `draft_vocab_size`,
  `norm_before_residual` (true when absent, as vLLM reads it), optional `target_hidden_size` and
  `eagle_aux_hidden_state_layer_ids`, the target under `speculators_config.verifier`; tensors `layers.0.*`.
- EAGLE-3 as its authors publish it (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a flat llama `config.json` with
  `draft_vocab_size` (and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`); tensors `midlayer.*`.
- EAGLE-1 as its authors publish it (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): a flat llama `config.json`; tensors
  `fc.*` and `layers.0.*`, no input norm on that layer (nor does vLLM apply one), the embedding shared with the target.

EAGLE-3 tensors: `fc.weight`, the layer's `input_layernorm`, `hidden_norm`, `self_attn.{q,k,v,o}_proj`,
`post_attention_layernorm`, `mlp.{gate,up,down}_proj`, then `norm.weight`, `lm_head.weight` [draft V, H], `d2t`
(draft row i is target token i + d2t[i]; absent: the first rows of the vocabulary), and optionally `t2d` (unused)
and `embed_tokens.weight` (its own embedding; otherwise the target's). Weights come from every `*.safetensors` file
in the folder, or `pytorch_model.bin`. Anything missing, unexpected or of the wrong shape is an error that names
it; `fit_head_to_target` then checks the head against the target it will serve (vocabulary, width, layers).
No hub is reachable from here: these loaders are tested on checkpoints the tests write in these layouts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from services.modeling.eagle3_head import Eagle3Config, Eagle3Head
from services.modeling.eagle_head import CONFIG_FILE, EagleConfig, EagleHead
from services.modeling.hidden_layers import check_hidden_layers, default_eagle3_layers

LAYER_TENSORS = {  # a published layer's tensor names -> the head's
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}


class HeadFormatError(ValueError):
    """The folder does not hold a head this loader reads, or the head does not fit the target."""


def load_eagle_head(folder: Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """The head in `folder`, in whichever layout it is (module docstring)."""
    folder = Path(folder).expanduser()
    if (folder / CONFIG_FILE).is_file():
        return EagleHead.load(folder, dtype)
    if not (folder / "config.json").is_file():
        raise HeadFormatError(f"{folder} holds no EAGLE head: expected {CONFIG_FILE} (specserve's) or config.json (a "
                              "published EAGLE-1 or EAGLE-3 head, or a speculators checkpoint)")
    fields = json.loads((folder / "config.json").read_text())
    kind = fields.get("speculators_model_type")
    if kind not in (None, "eagle3"):  # before reading any weights
        raise HeadFormatError(f"{folder}: speculators model type {kind!r} is not supported (only 'eagle3')")
    tensors = {name.removeprefix("model."): t for name, t in read_tensors(folder).items()}
    if kind is not None:
        head = _eagle3(folder, _speculators_fields(fields), tensors, "layers.0.", norm_before_residual_default=True)
    elif "draft_vocab_size" in fields or any(name.startswith("midlayer.") for name in tensors):
        head = _eagle3(folder, fields, tensors, "midlayer.", norm_before_residual_default=False)
    else:
        head = _eagle1(folder, fields, tensors)
    return head.to(dtype).eval()


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise HeadFormatError(f"{folder} has a config.json but no weights (*.safetensors or pytorch_model.bin)")


def fit_head_to_target(head: EagleHead, target_config, folder: Path | str = "") -> None:
    """HeadFormatError unless the head can serve this target (a transformers config): the same vocabulary, the
    width of the states it reads, layers the target has. An EAGLE-3 head whose config names no layers reads vLLM's
    default ones for the target's depth, set here."""
    c = head.config
    where = f"the EAGLE head at {folder}" if folder else "the EAGLE head"
    if c.vocab_size != target_config.vocab_size:
        raise HeadFormatError(f"{where} has a vocabulary of {c.vocab_size} tokens, the target "
                              f"{target_config.vocab_size}: it was built for another model")
    width = c.target_layer_width
    if width != target_config.hidden_size:
        raise HeadFormatError(f"{where} reads target states {width} wide, the target's are {target_config.hidden_size}")
    if isinstance(c, Eagle3Config) and not c.target_layers:
        head.config = replace(c, target_layers=default_eagle3_layers(target_config.num_hidden_layers))
    try:
        check_hidden_layers(head.config.hidden_layers, target_config.num_hidden_layers)
    except ValueError as error:
        raise HeadFormatError(f"{where}: {error}") from None
    if head.draft_vocab is not None and int(head.draft_vocab.max()) >= c.vocab_size:
        raise HeadFormatError(f"{where} maps draft tokens past the target's vocabulary ({c.vocab_size})")


# -- the layouts -------------------------------------------------------------------------------------------------
def _speculators_fields(fields: dict) -> dict:
    """A speculators config flattened as vLLM reads it: the layer's fields plus the EAGLE-3 ones; the target's
    name from `speculators_config.verifier`."""
    layer = fields.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadFormatError("speculators config: transformer_layer_config is missing")
    flat = {**layer, **{k: fields[k] for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                                                "eagle_aux_hidden_state_layer_ids") if fields.get(k) is not None}}
    verifier = (fields.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        flat["target_name"] = verifier["name_or_path"]
    return flat


def _layer_fields(folder: Path, fields: dict) -> dict:
    try:
        theta = fields.get("rope_theta") or (fields.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return dict(hidden_size=int(fields["hidden_size"]), intermediate_size=int(fields["intermediate_size"]),
                    num_attention_heads=int(fields["num_attention_heads"]),
                    num_key_value_heads=int(fields.get("num_key_value_heads") or fields["num_attention_heads"]),
                    rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                    vocab_size=int(fields["vocab_size"]))
    except KeyError as error:
        raise HeadFormatError(f"{folder}/config.json lacks {error.args[0]!r}") from None


def _eagle3(folder: Path, fields: dict, tensors: dict[str, torch.Tensor], prefix: str,
            norm_before_residual_default: bool) -> Eagle3Head:
    base = _layer_fields(folder, fields)
    # none named: vLLM's default for the target's depth, set once the target is known (fit_head_to_target)
    target_layers = (fields.get("eagle_aux_hidden_state_layer_ids")
                     or (fields.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ())
    draft_vocab_size = int(fields.get("draft_vocab_size") or base["vocab_size"])
    head_dim = int(fields.get("head_dim") or 0)
    config = Eagle3Config(
        **base, draft_vocab_size=draft_vocab_size,
        target_hidden_size=int(fields.get("target_hidden_size") or base["hidden_size"]),
        target_layers=tuple(int(i) for i in target_layers), target=str(fields.get("target_name", "")),
        norm_before_residual=bool(fields.get("norm_before_residual", norm_before_residual_default)),
        head_dim_override=head_dim if head_dim and head_dim != base["hidden_size"] // base["num_attention_heads"]
        else 0,
    )
    head = Eagle3Head(config)
    names = {prefix + k: v for k, v in LAYER_TENSORS.items()}
    names |= {prefix + "input_layernorm.weight": "input_norm.weight", prefix + "hidden_norm.weight": "hidden_norm.weight",
              "fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    extra = {"d2t", "t2d", "embed_tokens.weight"}
    _load(folder, head, tensors, names, extra)
    if "d2t" in tensors:
        d2t = tensors["d2t"]
        if d2t.shape != (draft_vocab_size,):
            raise HeadFormatError(f"{folder}: d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}]")
        head.draft_vocab.copy_(torch.arange(draft_vocab_size) + d2t.long())
    if "embed_tokens.weight" in tensors:
        embedding = tensors["embed_tokens.weight"]
        if embedding.shape != (config.vocab_size, config.hidden_size):
            raise HeadFormatError(f"{folder}: embed_tokens.weight has shape {list(embedding.shape)}, expected "
                                  f"[{config.vocab_size}, {config.hidden_size}]")
        head.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.float(), freeze=True)
    return head


def _eagle1(folder: Path, fields: dict, tensors: dict[str, torch.Tensor]) -> EagleHead:
    if "fc.weight" not in tensors or "layers.0.self_attn.q_proj.weight" not in tensors:
        raise HeadFormatError(f"{folder} is not an EAGLE head: its weights have no fc.weight and layers.0.* (found "
                              f"{', '.join(sorted(tensors)[:6])}{', ...' if len(tensors) > 6 else ''})")
    config = EagleConfig(**_layer_fields(folder, fields), input_norm=False, fc_bias="fc.bias" in tensors)
    head = EagleHead(config)
    names = {"layers.0." + k: v for k, v in LAYER_TENSORS.items()} | {"fc.weight": "fc.weight"}
    if config.fc_bias:
        names["fc.bias"] = "fc.bias"
    # the embedding is the target's (vLLM ignores this copy too); layer 0's input norm is never applied
    _load(folder, head, tensors, names, {"embed_tokens.weight", "layers.0.input_layernorm.weight"})
    return head


def _load(folder: Path, head: torch.nn.Module, tensors: dict[str, torch.Tensor], names: dict[str, str],
          ignored: set[str]) -> None:
    missing = sorted(name for name in names if name not in tensors)
    if missing:
        raise HeadFormatError(f"{folder}: the weights lack {', '.join(missing)}")
    unexpected = sorted(name for name in tensors if name not in names and name not in ignored)
    if unexpected:
        raise HeadFormatError(f"{folder}: unexpected tensors {', '.join(unexpected[:8])} (not a layout this loader "
                              "reads: attention biases or more than one layer are not supported)")
    own = head.state_dict()
    for published, name in names.items():
        value = tensors[published]
        if value.shape != own[name].shape:
            raise HeadFormatError(f"{folder}: {published} has shape {list(value.shape)}, the config implies "
                                  f"{list(own[name].shape)}")
        own[name] = value.float()
    head.load_state_dict(own)


def save_speculators(head: Eagle3Head, folder: Path, extra: dict | None = None) -> None:
    """An EAGLE-3 head as a speculators checkpoint (config.json + model.safetensors, fp16), the layout vLLM loads
    and load_eagle_head reads back; `extra` (training progress) goes under the config's "specserve" key."""
    from safetensors.torch import save_file

    c = head.config
    own = head.state_dict()
    tensors = {"layers.0." + published: own[name] for published, name in LAYER_TENSORS.items()}
    tensors |= {"layers.0.input_layernorm.weight": own["input_norm.weight"],
                "layers.0.hidden_norm.weight": own["hidden_norm.weight"], "fc.weight": own["fc.weight"],
                "norm.weight": own["norm.weight"], "lm_head.weight": own["lm_head.weight"]}
    tensors = {name: t.detach().to(torch.float16).contiguous() for name, t in tensors.items()}
    draft_vocab = head.draft_vocab.long()
    tensors["d2t"] = (draft_vocab - torch.arange(len(draft_vocab))).contiguous()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    tensors["t2d"] = t2d
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
             "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
             "hidden_act": "silu", "tie_word_embeddings": False}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
              "norm_before_residual": c.norm_before_residual, "target_hidden_size": c.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(c.target_layers),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                     "verifier": {"name_or_path": c.target, "architectures": []}},
              **({"specserve": extra} if extra else {})}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
