"""Training data for an EAGLE head: the target's own greedy answers to ShareGPT prompts, with its features,
written by the verifier's engine in `extract_hidden_states` mode.

A head is judged on the text the target writes (serving verifies its drafts against the target), so it learns best
from that text, not from the ShareGPT answers (written by other models): the first user turn of each training
conversation, in the target's chat template, is answered greedily by specserve's own engine (continuous batching,
about twice transformers' batched `generate` here), which writes each finished request's token ids and final
hidden states (of the layers the head reads, and the final one) to `<folder>/<index>.safetensors`
(services/verifier/hidden_state_files.py). These are the very
features the verifier sends an EAGLE drafter when serving, from the same model runner. A run that stops resumes:
prompts whose file exists are not asked again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class Example:
    """One answered prompt: token ids [T], the prompt's length, the target's states the head reads [T-1, layers * H]
    (float16; row t is the state after token t; the last token has none) and its final states [T-1, H], whose
    logits are the distributions the head learns."""

    ids: torch.Tensor
    prompt_len: int
    features: torch.Tensor
    final: torch.Tensor


def chat_prompts(tokenizer, conversations: Sequence[list[dict[str, str]]], max_prompt: int) -> Iterator[list[int]]:
    """The first user turn of each conversation in the chat template, up to `max_prompt` tokens (longer ones are
    skipped: cutting them would cut the template's assistant header too)."""
    from services.gateway.tokenizer import encode_chat

    for messages in conversations:
        try:
            ids = encode_chat(tokenizer, messages[:1])
        except ValueError:
            continue
        if len(ids) <= max_prompt:
            yield ids


def request_id(index: int) -> str:
    return f"prompt-{index:06d}"


async def _answer_all(engine, prompts: Sequence[list[int]], todo: list[int], max_new_tokens: int,
                      concurrency: int, progress: Callable[[int], None]) -> None:
    from services.verifier.sampling_params import GenerationRequest, SamplingParams

    queue = list(todo)

    async def worker() -> None:
        while queue:
            index = queue.pop(0)
            request = GenerationRequest(request_id(index), tuple(prompts[index]),
                                        SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
            async for _ in engine.generate(request):
                pass
            progress(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def extract(loaded, prompts: Sequence[list[int]], folder: Path, *, max_new_tokens: int, concurrency: int,
            progress: Callable[[int], None] = lambda n: None, layers: Sequence[int] = (-1,)) -> None:
    """Answer every prompt whose file is not in `folder` yet (greedy, `max_new_tokens` at most), writing its file
    with the states of the target `layers` (services/modeling/hidden_layers.py)."""
    from services.modeling.runner_factory import create_runner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.hidden_state_files import file_for

    folder.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(prompts)) if not file_for(folder, request_id(i)).exists()]
    progress(len(prompts) - len(todo))
    if not todo:
        return
    longest = max(len(prompts[i]) for i in todo) + max_new_tokens
    runner = create_runner(loaded.model, concurrency, longest)
    config = EngineConfig(max_num_batched_tokens=1024, log_stats_interval_s=0, adaptive_speculation=False,
                          max_waiting_requests=concurrency, extract_hidden_states_dir=folder,
                          hidden_layers=tuple(layers))

    async def run() -> None:
        async with Engine(runner, config, {}, loaded.eos_token_ids) as engine:
            await _answer_all(engine, prompts, todo, max_new_tokens, concurrency, progress)

    asyncio.run(run())


def extracted_files(folder: Path, count: int) -> list[Path]:
    """The files of prompts 0..count-1 that exist (a request that ended before its prefill wrote none)."""
    from services.verifier.hidden_state_files import file_for

    return [path for path in (file_for(folder, request_id(i)) for i in range(count)) if path.exists()]


def read_examples(paths: Sequence[Path], layers: Sequence[int] = (-1,)) -> list[Example]:
    """Extracted files as examples: the states of `layers` side by side, as a head reads them, and the final
    ones. A file without those layers is an error naming what it has."""
    from safetensors import safe_open

    examples = []
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            prompt_len = int(f.metadata()["num_prompt_tokens"])
            has = json.loads(f.metadata()["layers"])
            if any(i not in has for i in (*layers, -1)):
                raise ValueError(f"{path} holds target layers {has}, not {sorted({*layers, -1})}: extract again")
            states = f.get_tensor("hidden_states")  # [T-1, layers, H]
            features = torch.cat([states[:, has.index(i)] for i in layers], dim=-1)
            examples.append(Example(f.get_tensor("token_ids"), prompt_len, features, states[:, has.index(-1)]))
    return examples
