"""Loading EAGLE heads in the layouts users have (services/modeling/eagle_head_files.py), on checkpoints these tests
write in those layouts (no hub is reachable here): a speculators EAGLE-3 checkpoint, an EAGLE-3 checkpoint as its
authors publish it (`midlayer.*`, pytorch_model.bin), and a published EAGLE-1 one. Each loaded head's first drafting
step equals a reference written out here from the published architecture (vLLM's Eagle3LlamaForCausalLM and
EagleLlamaForCausalLM), independently of the head's own code: at one position attention returns the value, so
the reference needs no attention. A folder that is not a head, or a head that does not fit the target, is refused
with a message naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.modeling.eagle3_head import Eagle3Head
from services.modeling.eagle_head import EagleHead
from services.modeling.eagle_head_files import HeadFormatError, fit_head_to_target, load_eagle_head
from services.modeling.eagle_heads import shipped_head
from tests.tiny_models import tiny_llama, word_tokenizer

V, H, I, HEADS, KV, D = 96, 64, 128, 4, 2, 16
DRAFT_V = 40
LAYERS = [0, 1, -1]


def llama_fields(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "vocab_size": V, **extra}


def layer_tensors(prefix: str, qkv_in: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    return {
        f"{prefix}self_attn.q_proj.weight": r(HEADS * D, qkv_in), f"{prefix}self_attn.k_proj.weight": r(KV * D, qkv_in),
        f"{prefix}self_attn.v_proj.weight": r(KV * D, qkv_in), f"{prefix}self_attn.o_proj.weight": r(H, HEADS * D),
        f"{prefix}post_attention_layernorm.weight": 1 + r(H), f"{prefix}input_layernorm.weight": 1 + r(H),
        f"{prefix}mlp.gate_proj.weight": r(I, H), f"{prefix}mlp.up_proj.weight": r(I, H),
        f"{prefix}mlp.down_proj.weight": r(H, I),
    }


def eagle3_tensors(prefix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = layer_tensors(prefix, 2 * H, g)
    d2t = torch.sort(torch.randperm(V, generator=g)[:DRAFT_V]).values - torch.arange(DRAFT_V)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(DRAFT_V) + d2t] = True
    return {**tensors, f"{prefix}hidden_norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
            "fc.weight": 0.2 * torch.randn(H, 3 * H, generator=g), "norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
            "lm_head.weight": torch.randn(DRAFT_V, H, generator=g), "d2t": d2t, "t2d": t2d}


def write(folder: Path, config: dict, tensors: dict[str, torch.Tensor], torch_bin: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if torch_bin:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def speculators_config(**extra) -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": llama_fields(), "draft_vocab_size": DRAFT_V,
            "eagle_aux_hidden_state_layer_ids": LAYERS,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}}, **extra}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def mlp_block(t: dict, prefix: str, hidden: torch.Tensor) -> torch.Tensor:
    normed = rms(hidden, t[f"{prefix}post_attention_layernorm.weight"])
    gate, up = normed @ t[f"{prefix}mlp.gate_proj.weight"].T, normed @ t[f"{prefix}mlp.up_proj.weight"].T
    return hidden + (torch.nn.functional.silu(gate) * up) @ t[f"{prefix}mlp.down_proj.weight"].T


def attend_one(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Attention at a single position: each query head returns its key/value head's value."""
    v = (x @ t[f"{prefix}self_attn.v_proj.weight"].T).view(KV, D)
    return v.repeat_interleave(HEADS // KV, dim=0).reshape(-1) @ t[f"{prefix}self_attn.o_proj.weight"].T


def eagle3_reference(t: dict, prefix: str, embedding: torch.Tensor, states: torch.Tensor,
                     norm_before_residual: bool) -> torch.Tensor:
    """Target-vocabulary logits (-inf off the draft vocabulary) of one first drafting step, as vLLM computes them."""
    feature = states @ t["fc.weight"].T
    normed = rms(feature, t[f"{prefix}hidden_norm.weight"])
    x = torch.cat([rms(embedding, t[f"{prefix}input_layernorm.weight"]), normed])
    hidden = (normed if norm_before_residual else feature) + attend_one(t, prefix, x)
    draft = rms(mlp_block(t, prefix, hidden), t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((V,), float("-inf"))
    logits[torch.arange(DRAFT_V) + t["d2t"]] = draft
    return logits


def head_logits(head: EagleHead, embedding: torch.Tensor, states: torch.Tensor, lm_head_weight=None) -> torch.Tensor:
    with torch.no_grad():
        out, _ = head.step(embedding[None, None], head.target_features(states[None, None]), 0, None)
        draft = head.draft_logits(out[0, -1], head.draft_weight(lm_head_weight))
    logits = torch.full((V,), float("-inf"))
    logits[head.token_ids(torch.arange(draft.shape[-1]))] = draft
    return logits


@pytest.mark.parametrize("layout", ["speculators", "speculators norm after residual", "authors' midlayer bin"])
def test_published_eagle3_heads_draft_as_the_published_architecture(tmp_path, layout):
    if layout.startswith("speculators"):
        prefix, config = "layers.0.", speculators_config()
        norm_before_residual = True  # vLLM reads an absent norm_before_residual as true for speculators
        if "after" in layout:
            config, norm_before_residual = speculators_config(norm_before_residual=False), False
        tensors = eagle3_tensors(prefix)
        folder = write(tmp_path / "head", config, tensors)
    else:
        prefix, norm_before_residual = "midlayer.", False
        tensors = eagle3_tensors(prefix)
        config = llama_fields(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_V,
                              eagle_config={"eagle_aux_hidden_state_layer_ids": LAYERS})
        folder = write(tmp_path / "head", config, tensors, torch_bin=True)
    head = load_eagle_head(folder)
    assert isinstance(head, Eagle3Head) and head.config.hidden_layers == tuple(LAYERS)
    assert head.config.norm_before_residual == norm_before_residual
    assert head.config.target == ("tiny-llama" if layout.startswith("speculators") else "")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        embedding, states = torch.randn(H, generator=g), torch.randn(3 * H, generator=g)
        expected = eagle3_reference(tensors, prefix, embedding, states, norm_before_residual)
        assert torch.allclose(head_logits(head, embedding, states), expected, atol=1e-4)


def test_an_eagle3_head_that_names_no_layers_reads_vllms_default_ones():
    config = speculators_config()
    del config["eagle_aux_hidden_state_layer_ids"]
    target = tiny_llama(seed=5, vocab_size=V)
    target.config.num_hidden_layers = 12  # fit reads only the config: a 12-layer target's defaults
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        head = load_eagle_head(write(Path(folder), config, eagle3_tensors("layers.0.")))
    fit_head_to_target(head, target.config)
    assert head.config.hidden_layers == (2, 6, 9)


def test_a_published_eagle1_head_drafts_as_the_published_architecture(tmp_path):
    g = torch.Generator().manual_seed(4)
    tensors = {**layer_tensors("layers.0.", H, g), "fc.weight": 0.2 * torch.randn(H, 2 * H, generator=g),
               "embed_tokens.weight": torch.randn(V, H, generator=g)}
    head = load_eagle_head(write(tmp_path / "head", llama_fields(), tensors, torch_bin=True))
    assert type(head) is EagleHead and head.config.hidden_layers == (-1,) and not head.config.fc_bias
    lm_head_weight = torch.randn(V, H, generator=g)
    for _ in range(3):
        embedding, state = torch.randn(H, generator=g), torch.randn(H, generator=g)
        x = torch.cat([embedding, state]) @ tensors["fc.weight"].T  # no input norm on the published layer 0
        out = mlp_block(tensors, "layers.0.", x + attend_one(tensors, "layers.0.", x))
        assert torch.allclose(head_logits(head, embedding, state, lm_head_weight), out @ lm_head_weight.T, atol=1e-4)


def test_specserves_own_heads_still_load(tmp_path):
    target = tiny_llama(seed=5, vocab_size=V)
    from services.modeling.eagle_head import EagleConfig

    head = EagleHead(EagleConfig.for_target(target.config, "tiny")).eval()
    head.save(tmp_path / "own")
    loaded = load_eagle_head(tmp_path / "own")
    assert type(loaded) is EagleHead and loaded.config == head.config


def test_what_is_wrong_with_a_folder_is_named(tmp_path):
    with pytest.raises(HeadFormatError, match="holds no EAGLE head"):
        load_eagle_head(tmp_path)
    tensors = eagle3_tensors("layers.0.")
    missing = {k: v for k, v in tensors.items() if k != "layers.0.hidden_norm.weight"}
    with pytest.raises(HeadFormatError, match="lack layers.0.hidden_norm.weight"):
        load_eagle_head(write(tmp_path / "missing", speculators_config(), missing))
    with pytest.raises(HeadFormatError, match=r"lm_head.weight has shape \[40, 64\], the config implies \[50, 64\]"):
        load_eagle_head(write(tmp_path / "shape", speculators_config(draft_vocab_size=50), tensors))
    with pytest.raises(HeadFormatError, match="unexpected tensors layers.0.self_attn.q_proj.bias"):
        load_eagle_head(write(tmp_path / "bias", speculators_config(),
                              {**tensors, "layers.0.self_attn.q_proj.bias": torch.zeros(HEADS * D)}))
    with pytest.raises(HeadFormatError, match="speculators model type 'mlp' is not supported"):
        load_eagle_head(write(tmp_path / "mlp", {**speculators_config(), "speculators_model_type": "mlp"}, tensors))
    with pytest.raises(HeadFormatError, match="not an EAGLE head"):
        load_eagle_head(write(tmp_path / "model", llama_fields(), {"model.embed_tokens.weight": torch.zeros(V, H)}))
    with pytest.raises(HeadFormatError, match="no weights"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps(speculators_config()))
        load_eagle_head(tmp_path / "empty")


def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path):
    head = load_eagle_head(write(tmp_path / "head", speculators_config(), eagle3_tensors("layers.0.")))
    fit_head_to_target(head, tiny_llama(seed=5, vocab_size=V).config)  # fits
    with pytest.raises(HeadFormatError, match="vocabulary of 96 tokens, the target 128"):
        fit_head_to_target(head, tiny_llama(seed=5, vocab_size=128).config)
    deep = speculators_config(eagle_aux_hidden_state_layer_ids=[0, 1, 5])
    head = load_eagle_head(write(tmp_path / "deep", deep, eagle3_tensors("layers.0.")))
    with pytest.raises(HeadFormatError, match="hidden layer 5 does not exist: the target has 2 decoder layers"):
        fit_head_to_target(head, tiny_llama(seed=5, vocab_size=V).config)
    wide = tiny_llama(seed=5, vocab_size=V).config
    wide.hidden_size = 128
    with pytest.raises(HeadFormatError, match="reads target states 64 wide, the target's are 128"):
        fit_head_to_target(head, wide)


def test_the_eagle_methods_build_a_drafter_from_a_published_head_and_refuse_the_wrong_kind(tmp_path):
    """`{"method": "eagle3", "model": HEAD, "target_model": TARGET}`: the drafter shares TARGET's embedding and
    declares the head's layers; the method must match the head's kind, and eagle3 needs a head (none ships)."""
    from services.common.drafter_methods import build_proposer
    from services.common.speculative_config import SpeculativeConfig

    target_dir = tmp_path / "target"
    tiny_llama(seed=5, vocab_size=V).save_pretrained(target_dir)
    word_tokenizer(V).save_pretrained(target_dir)
    head_dir = write(tmp_path / "head", speculators_config(), eagle3_tensors("layers.0."))

    def config(**fields) -> SpeculativeConfig:
        return SpeculativeConfig.model_validate({"num_speculative_tokens": 3, **fields})

    proposer = build_proposer(config(method="eagle3", model=str(head_dir), target_model=str(target_dir)))
    assert proposer.method == "eagle3" and isinstance(proposer.head, Eagle3Head)
    assert proposer.capabilities.hidden_layers == tuple(LAYERS) and proposer.state_width == 3 * H
    with pytest.raises(ValueError, match="is an EAGLE-3 head: use method 'eagle3'"):
        build_proposer(config(method="eagle", model=str(head_dir), target_model=str(target_dir)))
    shipped = load_eagle_head(shipped_head(method="eagle3"))  # what eagle3 without a model drafts with
    assert isinstance(shipped, Eagle3Head) and shipped.config.hidden_layers == (2, 15, 27)
    with pytest.raises(Exception, match="tiny-llama"):  # the head names a target that is nowhere here
        build_proposer(config(method="eagle3", model=str(head_dir)))
