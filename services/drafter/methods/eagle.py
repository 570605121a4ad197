"""EAGLE speculation (`--method eagle --model HEAD_DIR`): a one-layer head drafts from the target's own hidden
states, which the verifier sends with the committed tokens (the drafter declares `needs_hidden_states`).

The head (services/modeling/eagle_head.py) shares the target's embedding and LM head, loaded here from the target
its config names (`target`, a --model spec), so the drafter must run beside a verifier serving that target (the
vocabulary fingerprint check enforces it). Per sequence the head keeps a KV cache over committed positions; a
step feeds the positions committed since the last one, then drafts a chain of K by argmax, feeding back its own
features, from a copy of that cache (drafts never enter it, so nothing needs rolling back).

Threads: every tensor operation runs on one worker thread, off the event loop (the drafter keeps answering
Info and health checks), as the draft-model drafter does; `release` only queues the id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.main_thread_compute import worker_thread
from services.common.proposer import Draft, DraftInput
from services.common.speculative_config import SpeculativeConfig
from services.modeling.eagle_head import EagleHead
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class HeadSequence:
    fed: int = 0  # head positions in `cache`: position t holds [embed(x_{t+1}); f_t]
    cache: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class EagleProposer:
    head: EagleHead
    embed: torch.nn.Module
    lm_head: torch.nn.Module
    vocab_size: int
    tokenizer_fingerprint: str = ""
    method: str = "eagle"
    needs_hidden_states: bool = True
    _sequences: dict[Hashable, HeadSequence] = field(default_factory=dict)
    _released: list[Hashable] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _compute: Executor | None = None

    @property
    def hidden_size(self) -> int:
        """The target state width the head reads (declared in Info, checked by the verifier)."""
        return self.head.config.hidden_size

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        if self._compute is None:
            self._compute = worker_thread()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute, self._draft_all, list(inputs))

    def release(self, seq_id: Hashable) -> None:
        with self._lock:
            self._released.append(seq_id)

    @torch.no_grad()
    def _draft_all(self, inputs: list[DraftInput]) -> list[Draft]:
        with self._lock:
            released, self._released = self._released, []
        for seq_id in released:
            self._sequences.pop(seq_id, None)
        return [self._draft(item) for item in inputs]

    def _draft(self, item: DraftInput) -> Draft:
        tokens, states = item.token_ids, item.hidden_states
        n = len(tokens) - 1  # the last committed token x_n; states exist for x_0..x_{n-1}
        if states is None or n < 1 or states.shape[0] < n or item.num_speculative_tokens < 1:
            return Draft([])
        seq = self._sequences.setdefault(item.seq_id, HeadSequence())
        if seq.fed > n - 1:  # the verifier re-sent a shorter sequence: start over
            seq.fed, seq.cache = 0, None
        states = states.to(self.embed.weight.dtype)
        if seq.fed < n - 1:  # commit positions fed..n-2: [x_{t+1}; f_t]
            ids = torch.tensor([list(tokens[seq.fed + 1 : n])])
            _, seq.cache = self.head.step(self.embed(ids), states[None, seq.fed : n - 1], seq.fed, seq.cache)
            seq.fed = n - 1
        cache, feature = seq.cache, states[None, n - 1 : n]
        token, drafts = int(tokens[n]), []
        for j in range(item.num_speculative_tokens):
            out, cache = self.head.step(self.embed(torch.tensor([[token]])), feature, n - 1 + j, cache)
            token = int(self.lm_head(out[:, -1]).argmax(-1))
            if token >= self.vocab_size:
                break
            drafts.append(token)
            feature = out
        return Draft(drafts)


def build_proposer(config: SpeculativeConfig) -> EagleProposer:
    from services.modeling.loading import load_model

    head_dir = Path(config.model or "").expanduser()
    if not (head_dir / "eagle_config.json").is_file():
        raise ValueError(f"method 'eagle' needs --model HEAD_DIR holding eagle_config.json; {head_dir} has none")
    head = EagleHead.load(head_dir)
    target_spec = head.config.target
    if not target_spec:
        raise ValueError(f"{head_dir}/eagle_config.json names no target model to share the embedding with")
    loaded = load_model(target_spec, device="cpu", dtype="float32")
    embed, lm_head = loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()
    logger.info("EAGLE head %s for %s (hidden %d)", head_dir, target_spec, head.config.hidden_size)
    return EagleProposer(head, embed, lm_head, int(loaded.model.config.vocab_size),
                         tokenizer_fingerprint(loaded.tokenizer))
