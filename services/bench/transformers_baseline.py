"""The peer to beat: Hugging Face `generate`, greedy, one prompt at a time, plain or with prompt lookup."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from services.bench.report import Generation


@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the target's forward calls: prompt lookup never calls the model to draft, so tokens per forward
    is the transformers analogue of the engine's tokens per step."""
    calls = [0]

    def hook(*_args) -> None:
        calls[0] += 1

    handle = model.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def generate_one(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    eos_token_ids: Sequence[int],
    prompt_lookup: tuple[int, int] | None = None,
) -> Generation:
    """One timed greedy `generate`; `prompt_lookup` = (K, max n-gram size) turns on prompt-lookup decoding."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt)], device=device)
    kwargs = {}
    if prompt_lookup is not None:
        kwargs = {"prompt_lookup_num_tokens": prompt_lookup[0], "max_matching_ngram_size": prompt_lookup[1]}
    with count_forwards(model) as calls, torch.inference_mode():
        started = time.perf_counter()
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(eos_token_ids) or None,
            pad_token_id=eos_token_ids[0] if eos_token_ids else 0,
            **kwargs,
        )
        seconds = time.perf_counter() - started
    return Generation(tuple(output[0, input_ids.shape[1] :].tolist()), seconds, calls[0])


def run_transformers(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_token_ids: Sequence[int],
    prompt_lookup: tuple[int, int] | None,
    progress: Callable[[str], None],
) -> tuple[Generation, ...]:
    """Each prompt on its own, as a user of `generate` would serve them."""
    results = []
    for i, prompt in enumerate(prompts):
        result = generate_one(model, prompt, max_tokens, eos_token_ids, prompt_lookup)
        progress(f"  prompt {i + 1}/{len(prompts)}: {len(result.tokens)} tokens in {result.seconds:.1f} s")
        results.append(result)
    return tuple(results)
