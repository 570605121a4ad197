"""A target's embedding and LM head read alone (vocabulary_weights.py) equal those of the whole model loaded.

An EAGLE drafter reads nothing else of the target; these tests hold the two paths equal bit for bit (the dtype cast
included), for tied and untied heads and sharded checkpoints, and check that a module of another kind than the
plain ones (Gemma 3's scaled embedding) loads the whole model instead of losing what it computes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from services.modeling.loading import load_model
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.modeling.vocabulary_weights import load_vocabulary_weights
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2, word_tokenizer


def saved(model, folder, **options):
    model.save_pretrained(folder, **options)
    word_tokenizer(VOCAB).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("build", "options"), [(tiny_llama, {}), (tiny_qwen2, {}),
                                                (tiny_llama, {"max_shard_size": "20KB"})],
                         ids=["untied", "tied", "sharded"])
def test_the_embedding_and_lm_head_read_alone_equal_the_whole_models(tmp_path, build, options, dtype):
    folder = saved(build(seed=3), tmp_path / "target", **options)
    if options:  # the sharded case is read through its index, from several files
        assert (tmp_path / "target" / "model.safetensors.index.json").exists()
        assert len(list((tmp_path / "target").glob("*.safetensors"))) > 2
    alone = load_vocabulary_weights(folder, device="cpu", dtype=dtype)
    loaded = load_model(folder, device="cpu", dtype=dtype)
    whole = loaded.model
    assert not alone.whole_model_loaded
    assert alone.embedding.weight.dtype == alone.lm_head.weight.dtype == getattr(torch, dtype)
    assert torch.equal(alone.embedding.weight, whole.get_input_embeddings().weight)
    assert torch.equal(alone.lm_head.weight, whole.get_output_embeddings().weight)
    assert (alone.lm_head.weight is alone.embedding.weight) == whole.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 7]])
    assert torch.equal(alone.embedding(ids), whole.get_input_embeddings()(ids))
    assert alone.config.vocab_size == whole.config.vocab_size
    assert tokenizer_fingerprint(alone.tokenizer) == tokenizer_fingerprint(loaded.tokenizer)  # what a drafter checks


def test_an_embedding_that_computes_more_than_its_weight_loads_the_whole_model(tmp_path):
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=256, sliding_window=64)
    folder = saved(Gemma3ForCausalLM(config).eval(), tmp_path / "gemma")
    alone = load_vocabulary_weights(folder, device="cpu", dtype="float32")
    whole = load_model(folder, device="cpu", dtype="float32").model
    assert alone.whole_model_loaded
    ids = torch.tensor([[1, 5, 7]])
    assert torch.equal(alone.embedding(ids), whole.get_input_embeddings()(ids))  # scaled, as the target scales
    assert not torch.equal(alone.embedding(ids), torch.nn.functional.embedding(ids, alone.embedding.weight))


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["untied", "tied"])
def test_a_part_not_asked_for_is_not_read(tmp_path, build, monkeypatch):
    import services.modeling.vocabulary_weights as vocabulary_weights

    folder = saved(build(seed=3), tmp_path / "target")
    whole = load_model(folder, device="cpu", dtype="float32").model
    read = []
    real_read = vocabulary_weights._read_tensors
    monkeypatch.setattr(vocabulary_weights, "_read_tensors", lambda f, names: read.append(names) or real_read(f, names))
    no_head = load_vocabulary_weights(folder, device="cpu", dtype="float32", lm_head=False)
    assert no_head.lm_head is None and torch.equal(no_head.embedding.weight, whole.get_input_embeddings().weight)
    assert read[-1] == ["model.embed_tokens.weight"]
    no_embedding = load_vocabulary_weights(folder, device="cpu", dtype="float32", embedding=False)
    assert no_embedding.embedding is None
    assert torch.equal(no_embedding.lm_head.weight, whole.get_output_embeddings().weight)
    # a tied head is the embedding's matrix, so that is what is read
    assert read[-1] == (["model.embed_tokens.weight"] if whole.config.tie_word_embeddings else ["lm_head.weight"])
