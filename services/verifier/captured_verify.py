"""Verification inside the step's captured graph, for the plain decode steps that most traffic makes.

On an accelerator a decode step replays one captured graph for its forward (step_graphs.py), but its verification
ran after it kernel by kernel: the LM head, the log-softmax, the noise, the acceptance rule, the packing of the
results, and the host-to-device copies of the drafts and sampling parameters. On an H100 that was 21 launches and
copies a replayed step (issue 29; the target is 2), each a few microseconds of host time in a step the host holds
up. VerifyTail is that same verification (rejection.verify, the same function, so the same tokens) as a GraphTail:
its inputs ride in the forward's static buffer and its output is the step's accepted tokens, so a step is one
copy in, one replay and one copy out.

It takes the common case only, where verify needs nothing but the logits, the drafts and each row's temperature
and seed: no grammar or token rules, no penalties, top-k, top-p or min-p, no logprobs, and no sampled row with a
drafter's q. A step with a token tree takes captured_tree_verify.TreeVerifyTail, the same rule on the tree
(`tail_for`), where no tree repeats a token among siblings. Any other step takes the eager tail in
step_execution.py, as before.
Greedy and sampled steps are two graphs (`sampled` is the key), so that a greedy step does not draw noise over
its whole vocabulary for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.verifier.captured_tree_verify import TreeVerifyTail, distinct_siblings
from services.verifier.draft_collection import ProposedDraft
from services.verifier.rejection import verify
from services.verifier.request_state import RequestState
from services.verifier.tail_rows import COLUMNS, TailRows, sampling_fields, unpack


def takes(states: Sequence[RequestState], drafts: Sequence[ProposedDraft], vocab_size: int) -> bool:
    """Whether these decode rows verify with nothing but VerifyTail's inputs."""
    for state, draft in zip(states, drafts, strict=True):
        fits = state.fits_verify_tail
        if fits is None:  # asked once a request: its settings are fixed, and this is read every step
            fits = state.fits_verify_tail = settings_fit(state, vocab_size)
        if not fits or (draft.probs is not None and not state.request.sampling.greedy):
            return False
        if draft.parents is not None and not distinct_siblings(draft):
            return False
    return True


def tail_for(states: Sequence[RequestState], drafts: Sequence[ProposedDraft]) -> VerifyTail | TreeVerifyTail:
    """The step's tail: VerifyTail for chains, TreeVerifyTail where a row has a tree."""
    if any(draft.parents is not None for draft in drafts):
        return TreeVerifyTail.of(states, drafts)
    return VerifyTail.of(states, drafts)


def settings_fit(state: RequestState, vocab_size: int) -> bool:
    """Whether the request's own settings leave its verification to the temperature and seed alone."""
    sampling = state.request.sampling
    return not (state.constraint is not None or sampling.uses_penalties or sampling.top_k_filters(vocab_size)
                or sampling.top_p_filters or sampling.min_p_filters or sampling.logprobs is not None)


@dataclass(frozen=True)
class VerifyTail(TailRows):
    """One step's verification as a GraphTail: per row its drafts, and what TailRows carries (its temperature 1
    for greedy rows, as SamplingBatch holds them)."""

    drafts: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, states: Sequence[RequestState], drafts: Sequence[ProposedDraft]) -> VerifyTail:
        return cls(drafts=tuple(tuple(d.tokens) for d in drafts), **sampling_fields(states))

    @property
    def key(self) -> tuple[str, bool]:
        return ("verify", self.sampled)

    def inputs(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width + 3] int64 (drafts padded with 0, their number, position, seed, greedy) then the rows'
        temperatures as float64 bits; padding rows draft nothing, greedily."""
        k, real = width - 1, len(self.drafts)
        ints = np.zeros((rows, k + COLUMNS), dtype=np.int64)  # numpy: torch.tensor on nested lists cost about twice
        counts = np.fromiter(map(len, self.drafts), dtype=np.int64, count=real)
        if k:  # the drafts row after row through one mask (a numpy slice per row cost about 1 us each)
            ints[:real, :k][np.arange(k) < counts[:, None]] = np.fromiter(
                chain.from_iterable(self.drafts), dtype=np.int64, count=int(counts.sum()))
        return self.pack_rows(ints, counts)

    def run(self, logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """[rows, width + 1] int64: each row's tokens (it emits the first num_accepted + 1) then num_accepted."""
        rows, width, vocab = logits.shape
        k = width - 1
        ints, counts, positions, batch = unpack(inputs, rows, k + COLUMNS, vocab, self.sampled)
        result = verify(logits, ints[:, :k], counts, positions, batch)
        return torch.cat([result.tokens, result.num_accepted[:, None]], dim=1)

    @staticmethod
    def read(result: Sequence[int]) -> tuple[list[int], int, None]:
        """A row of run()'s output on the host: (the emitted tokens, num_accepted, None: a chain keeps its first
        num_accepted + 1 fed positions)."""
        num_accepted = result[-1]
        return list(result[: num_accepted + 1]), num_accepted, None


def prototypes(trees: bool) -> tuple[VerifyTail | TreeVerifyTail, ...]:
    """What the engine captures ahead for verify widths, beside the plain graphs: a greedy and a sampled step, and
    the same for trees where a drafter sends them."""
    chains = (VerifyTail(sampled=False), VerifyTail(sampled=True))
    return chains + (TreeVerifyTail(sampled=False), TreeVerifyTail(sampled=True)) if trees else chains
