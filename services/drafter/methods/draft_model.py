"""Draft-model speculation (`--method draft_model --model NAME`): a small causal LM that shares the target's
vocabulary drafts K tokens by greedy decoding (argmax: the drafts are deterministic, no q is sent, and the
verifier's rule for one-hot drafts keeps the output lossless at any temperature).

Why its own service pays off here: the draft model's forwards run in the drafter process, on its own device and
threads, while the verifier runs the target; a verifier with a draft model in-process would serialise both on
one compute thread. The drafter keeps a KV cache per sequence in the same model runner the verifier uses
(services/modeling), so a step feeds only the tokens committed since the last one; model_drafting.py does the
tensor work and sequence_slots.py decides which sequences keep a slot.

The drafter declares its vocabulary size and tokenizer fingerprint in Info (its `capabilities`, see
services/common/proposer.ProposerCapabilities), so a verifier whose target has
another vocabulary refuses it instead of verifying token ids that mean something else.

Pipelining (`draft_pipelining`): after answering a call, the proposer pre-drafts the next step on the compute
thread while the verifier verifies (services/drafter/draft_pipelining.py); the next call stops it if it is still
running, and uses it when its guess held.

Threads: every tensor operation runs on one compute thread, off the event loop, so the drafter keeps answering
Info, health checks and other links while it drafts. Which thread is measured at start-up exactly as for the
verifier engine (services/modeling/compute_placement.py: the main thread where its torch pool is faster, the
asyncio loop then beside it; a worker thread otherwise); the drafter service hands it over with `use_compute`.
A call the engine gave up on (its deadline passed) still runs to the end on that thread, and the next call
queues behind it, so the KV bookkeeping only ever changes on that thread. `release`
is called on the event loop: it only queues the id, and the next call frees the slot on the compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from services.common.main_thread_compute import worker_thread
from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.common.speculative_config import SpeculativeConfig
from services.drafter.draft_pipelining import PreDraftRunner, default_pipelining, wants_predraft
from services.drafter.model_drafting import DraftRequest, ModelDrafter
from services.modeling.context_length import resolve_max_model_len
from services.modeling.loading import load_model
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner
from services.modeling.step_graphs import GraphSettings
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModelSettings:
    """The draft_model fields of SpeculativeConfig (flags: --model, --device, --dtype, --max-num-seqs,
    --max-model-len of `specserve drafter`)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: the model's whole context (services/modeling/context_length.py)
    pipelining: bool | None = None  # pre-draft the next step while the verifier verifies; None: where it pays

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("method 'draft_model' needs a model (--model, or 'model' in --speculative-config)")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> DraftModelSettings:
        return cls(
            model=config.model or "",
            device=config.draft_device,
            dtype=config.draft_dtype,
            max_num_seqs=config.draft_max_num_seqs,
            max_model_len=config.max_model_len,
            pipelining=config.draft_pipelining,
        )


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, runner: ModelRunner, tokenizer_fingerprint: str = "", compute: Executor | None = None,
                 pipelining: bool = False) -> None:
        """`runner`: the draft model's, empty (its max_num_seqs slots and max_model_len bound what is drafted).
        `compute`: the executor for the tensor work, one thread (default: a worker thread of its own).
        `pipelining`: after each call, pre-draft the next step on the guess that this one is accepted whole, for
        the sequences whose request does not say otherwise (DraftInput.pipelining)."""
        # declared in Info: its vocabulary (a verifier with another refuses it), and a request may set
        # draft_pipelining; the fingerprint is "" when unknown
        self.capabilities = ProposerCapabilities(vocab_size=runner.vocab_size,
                                                 tokenizer_fingerprint=tokenizer_fingerprint, pre_drafts=True)
        self._drafter = ModelDrafter(runner)
        self._released: list[Hashable] = []
        self._released_lock = threading.Lock()
        self._owns_compute = compute is None
        self._compute = compute if compute is not None else worker_thread()
        self.pipelining = pipelining
        self.predrafting = PreDraftRunner()

    @property
    def pipeline_counts(self):
        """Pre-drafts used and discarded, and the drafting seconds they hid (draft_pipelining.PipelineCounts)."""
        return self._drafter.predrafts.counts

    @property
    def runner(self) -> ModelRunner:
        """The draft model's runner: the drafter service times its forwards to place them on a thread."""
        return self._drafter.runner

    def measure_catch_up(self) -> None:
        """Time a prefill, so that long prompts are fed in chunks that fit the verifier's draft deadline
        (model_drafting.CatchUpBudget); on the calling thread, before serving."""
        self._drafter.measure_catch_up()

    def catch_up_limit(self) -> int | None:
        return self._drafter.catch_up.limit()

    def use_compute(self, compute: Executor) -> None:
        """Run the tensor work on `compute` from now on (one thread); call before the first `propose`."""
        if self._owns_compute:
            self._compute.shutdown(wait=True)
        self._compute, self._owns_compute = compute, False

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        # Snapshots taken on the loop: the caller appends to token_ids once this step is over, possibly while a
        # call it gave up on is still running on the compute thread.
        requests = [
            DraftRequest(item.seq_id, np.array(item.token_ids, dtype=np.int64), item.num_speculative_tokens)
            for item in inputs
        ]
        if not requests:
            return []
        self.predrafting.call_arrived()
        drafted = await asyncio.get_running_loop().run_in_executor(self._compute, self._draft, requests)
        ahead = [i for i, item in enumerate(inputs) if wants_predraft(item, self.pipelining)]
        if ahead:
            self.predrafting.start(self._compute, self._drafter.predraft, [requests[i] for i in ahead],
                                   [drafted[i] for i in ahead])
        return [Draft(tokens) for tokens in drafted]

    def release(self, seq_id: Hashable) -> None:
        """Queued for the compute thread (a call may be using the runner right now)."""
        with self._released_lock:
            self._released.append(seq_id)

    def close(self) -> None:
        """Stop the compute thread, if it is this proposer's own (after the call in flight)."""
        if self._owns_compute:
            self._compute.shutdown(wait=True)

    def _draft(self, requests: list[DraftRequest]) -> list[tuple[int, ...]]:
        """On the compute thread: free released slots, then draft."""
        with self._released_lock:
            released, self._released = self._released, []
        for seq_id in released:
            self._drafter.forget(seq_id)
        return self._drafter.draft(requests)


def build_proposer(config: SpeculativeConfig) -> DraftModelProposer:
    """The registry's entry point: load the draft model (as the verifier loads its target) and its runner. On an
    accelerator its step graphs are captured before serving (unless enforce_eager): the catch-up feeds of up to
    K + 1 tokens a row and the K one-token draft forwards, for up to max_num_seqs rows, so no draft call waits
    on a capture (each took a good part of the verifier's draft deadline, as the EAGLE head's did on an H200)."""
    settings = DraftModelSettings.from_config(config)
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype)
    max_model_len = resolve_max_model_len(loaded.model, settings.max_model_len)
    # its drafts never decide the output, so on CPU its linears may run bfloat16 copies where faster (head_kernels.py)
    runner = create_runner(loaded.model, settings.max_num_seqs, max_model_len, owns_model=True, allow_bf16=True,
                           graphs=GraphSettings(enforce_eager=config.enforce_eager))
    if captured := runner.capture_graphs(config.num_speculative_tokens + 1):
        logger.info("draft model: captured %d step graphs before serving", captured)
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    if settings.pipelining is None:
        pipelining, why = default_pipelining(runner.device.type)
    else:
        pipelining, why = settings.pipelining, "set in the speculative config"
    proposer = DraftModelProposer(runner, fingerprint, pipelining=pipelining)
    proposer.measure_catch_up()
    logger.info(
        "draft model %s: vocabulary %d (tokenizer %s), %d sequences of up to %d positions; prefills fed in chunks of "
        "up to %d tokens per call; pipelining %s (%s)", loaded.model_id, runner.vocab_size,
        fingerprint[:12] or "unknown", settings.max_num_seqs, max_model_len, proposer.catch_up_limit(),
        "on" if pipelining else "off", why,
    )
    return proposer
