"""The llama-family runner reproduces transformers' own forward, across batching, offsets and rollback."""

from __future__ import annotations

import pytest
import torch

from services.modeling.generic_runner import GenericRunner
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from tests.tiny_models import tiny_llama, tiny_qwen2

ATOL = 1e-4


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()  # [T, V]


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_llama() if request.param == "llama" else tiny_qwen2()


def unpacked_llama_runner(model, max_num_seqs, max_model_len):
    return LlamaFamilyRunner(model, max_num_seqs, max_model_len, pack_weights=False)


@pytest.fixture(
    params=[LlamaFamilyRunner, unpacked_llama_runner, GenericRunner], ids=["llama_runner", "unpacked", "generic"]
)
def runner_class(request):
    return request.param


def test_prefill_in_chunks_matches_full_forward(model, runner_class):
    runner = runner_class(model, max_num_seqs=2, max_model_len=64)
    tokens = torch.randint(0, model.config.vocab_size, (30,)).tolist()
    expected = reference_logits(model, tokens)
    runner.add_sequence("a")
    first = runner.forward([RowInput("a", tokens[:11], num_logits=11)])
    second = runner.forward([RowInput("a", tokens[11:], num_logits=19)])
    got = torch.cat([first.logits[0], second.logits[0]])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
    assert runner.length("a") == 30


def test_batched_rows_at_different_offsets_match(model, runner_class):
    runner = runner_class(model, max_num_seqs=4, max_model_len=64)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 9)]
    for i, prompt in enumerate(prompts):
        runner.add_sequence(i)
        runner.forward([RowInput(i, prompt[:-3], num_logits=0 if runner_class is not GenericRunner else 1)])
    # one batched step feeds each row's last 3 tokens; rows have different lengths and offsets
    out = runner.forward([RowInput(i, prompt[-3:], num_logits=3) for i, prompt in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out.logits[i], reference_logits(model, prompt)[-3:], atol=ATOL, rtol=1e-4)


def test_rollback_then_continue_matches(model, runner_class):
    runner = runner_class(model, max_num_seqs=1, max_model_len=64)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (12,)).tolist()
    runner.add_sequence("s")
    runner.forward([RowInput("s", prompt, num_logits=1)])
    rejected = torch.randint(0, vocab, (5,)).tolist()
    runner.forward([RowInput("s", rejected, num_logits=5)])
    runner.truncate("s", 12 + 2)  # keep two of the five, drop the rest
    kept = prompt + rejected[:2]
    continuation = torch.randint(0, vocab, (4,)).tolist()
    out = runner.forward([RowInput("s", continuation, num_logits=4)])
    torch.testing.assert_close(
        out.logits[0], reference_logits(model, kept + continuation)[-4:], atol=ATOL, rtol=1e-4
    )


def test_freeing_a_slot_keeps_other_sequences_intact(model):
    """Removing a middle sequence moves the last slot's KV down; the moved sequence must not notice."""
    runner = LlamaFamilyRunner(model, max_num_seqs=3, max_model_len=64)
    vocab = model.config.vocab_size
    prompts = {name: torch.randint(0, vocab, (n,)).tolist() for name, n in (("a", 7), ("b", 9), ("c", 13))}
    for name, prompt in prompts.items():
        runner.add_sequence(name)
        runner.forward([RowInput(name, prompt[:-1], num_logits=1)])
    runner.remove_sequence("a")
    assert runner.num_free_slots() == 1
    out = runner.forward([RowInput(name, prompts[name][-1:], num_logits=1) for name in ("c", "b")])
    torch.testing.assert_close(out.logits[0, 0], reference_logits(model, prompts["c"])[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, 0], reference_logits(model, prompts["b"])[-1], atol=ATOL, rtol=1e-4)
    runner.add_sequence("d")  # reuses the freed slot
    assert runner.num_free_slots() == 0
    with pytest.raises(RuntimeError, match="no free"):
        runner.add_sequence("e")


def test_hidden_states_match_transformers(model):
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=32)
    tokens = torch.randint(0, model.config.vocab_size, (10,)).tolist()
    runner.add_sequence(0)
    out = runner.forward([RowInput(0, tokens, num_logits=1)])
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(out.hidden_states[0], expected, atol=ATOL, rtol=1e-4)


def test_exceeding_max_model_len_is_refused(model):
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=8)
    runner.add_sequence(0)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.forward([RowInput(0, list(range(9)), num_logits=1)])
