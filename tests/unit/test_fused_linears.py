"""Fused sibling linears (fused_linears.py): the same outputs, the weights stored once."""

from __future__ import annotations

import random

import pytest
import torch

from services.modeling.fused_linears import fuse_in_place
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LayerKernels, LlamaFamilyRunner
from services.modeling.runner import RowInput
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2


@pytest.mark.parametrize("bias", [False, True])
def test_one_matmul_gives_each_modules_output_and_the_modules_share_its_weight(bias):
    torch.manual_seed(0)
    modules = [torch.nn.Linear(16, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(3, 16)
    expected = torch.cat([m(x) for m in modules], dim=-1)
    fused = fuse_in_place(modules)
    torch.testing.assert_close(fused(x), expected)
    torch.testing.assert_close(torch.cat([m(x) for m in modules], dim=-1), expected)  # the modules still run
    storages = {m.weight.untyped_storage().data_ptr() for m in modules}
    assert len(storages) == 1 and sum(m.weight.shape[0] for m in modules) == 16  # one copy, rows in order
    if bias:
        assert len({m.bias.untyped_storage().data_ptr() for m in modules}) == 1
    again = fuse_in_place(modules)  # a second runner on the same model: no second copy
    assert {m.weight.untyped_storage().data_ptr() for m in modules} == storages
    torch.testing.assert_close(again(x), expected)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_a_runner_on_fused_linears_matches_the_modules(make_model):
    """What an accelerator runs (LayerKernels.fused), tried on CPU against the plain modules."""
    plain_model, fused_model = make_model(), make_model()
    fused_model.load_state_dict(plain_model.state_dict())
    runners = [LlamaFamilyRunner(model, max_num_seqs=2, max_model_len=128, pack_weights=False,
                                 kv_cache=KVCacheConfig(memory_bytes=4 << 20, block_size=8))
               for model in (plain_model, fused_model)]
    runners[1]._kernels = [LayerKernels.fused(layer) for layer in fused_model.model.layers]
    assert runners[1].kernels == "F.linear, q/k/v and gate/up fused"
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    outputs = []
    for runner in runners:
        runner.add_sequence("a")
        runner.forward([RowInput("a", prompt, num_logits=1)])
        outputs.append(runner.forward([RowInput("a", [3, 4, 5], num_logits=3)]).logits)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
