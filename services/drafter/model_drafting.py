"""Greedy drafting with a small causal LM through the model runner: the tensor work of the draft_model method.

Everything here runs on one thread (the proposer's compute thread) and is neither async nor thread-safe; the
proposer (methods/draft_model.py) owns that thread. One call drafts every sequence of an engine step together:

1. each sequence gets a KV slot in the runner (sequence_slots.py: least recently used eviction);
2. its slot is truncated to the longest common prefix of the tokens it holds and the committed tokens ("set
   the length"), keeping at least one committed token to feed, since the last one's logits give the first draft;
3. one catch-up forward feeds every sequence's remaining committed tokens (usually the bonus token, or the last
   accepted draft and the bonus token; the whole prompt for a new or evicted sequence), batched;
4. then one batched forward per draft position, one argmax token per row still drafting (rows asking fewer
   tokens drop out), so K tokens cost K forwards whatever the number of sequences.

The tokens fed while drafting stay in the slot: when the verifier accepts them, the next call finds them in the
common prefix and does not feed them again.

Sequences that cannot be drafted get an empty draft, never an error: K of 0, no committed token, longer than the
runner's max_model_len (K is also clamped so the drafts fit), a token id outside the draft model's vocabulary,
or no free slot because every slot belongs to a sequence of the same call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from services.drafter.sequence_slots import SequenceSlots, common_prefix_length
from services.modeling.runner import ModelRunner, RowInput

# A catch-up forward is padded to its longest row. Below this many token positions in all, a forward costs
# about the same however wide it is (reading the weights dominates), so rows are batched freely; above it, a
# row joins a batch only while padding at most doubles the tokens computed (a prompt being prefilled does not
# make every decoding row pay for its length).
FREE_PADDING_TOKENS = 64


@dataclass(frozen=True)
class DraftRequest:
    """One sequence of a call: its committed tokens (a snapshot the caller no longer changes) and K."""

    seq_id: Hashable
    token_ids: np.ndarray  # int64, prompt first
    num_speculative_tokens: int


class ModelDrafter:
    def __init__(self, runner: ModelRunner) -> None:
        """`runner` must hold no sequences: its slots are this drafter's to give out."""
        if runner.num_free_slots() != runner.max_num_seqs:
            raise ValueError("the draft model's runner must start empty")
        self.runner = runner
        self.slots = SequenceSlots(runner.max_num_seqs)

    def forget(self, seq_id: Hashable) -> None:
        """Free the sequence's slot, if it holds one."""
        if self.slots.drop(seq_id):
            self.runner.remove_sequence(seq_id)

    def draft(self, requests: Sequence[DraftRequest]) -> list[tuple[int, ...]]:
        """Up to K argmax tokens per request, in order; () where it cannot be drafted (module docstring)."""
        drafts: list[tuple[int, ...]] = [()] * len(requests)
        chosen = self._draftable(requests)
        assignment = self.slots.assign([requests[i].seq_id for i in chosen])
        for seq_id in assignment.evicted:
            self.runner.remove_sequence(seq_id)
        for seq_id in assignment.admitted:
            self.runner.add_sequence(seq_id)
        refused = set(assignment.refused)
        rows = [i for i in chosen if requests[i].seq_id not in refused]
        if not rows:
            return drafts
        try:
            feeds = [self._feed(requests[i]) for i in rows]
            ks = [self._room(requests[i]) for i in rows]
            proposed = self._draft_rows([requests[i].seq_id for i in rows], feeds, ks)
        except BaseException:
            for i in rows:  # what the slots hold is unknown now: start these sequences afresh next time
                self.forget(requests[i].seq_id)
            raise
        for i, tokens in zip(rows, proposed, strict=True):
            request = requests[i]
            fed = np.asarray(tokens[:-1], dtype=np.int64)  # the last draft is never fed
            self.slots.set_tokens(request.seq_id, np.concatenate([request.token_ids, fed]))
            drafts[i] = tuple(tokens)
        return drafts

    def _room(self, request: DraftRequest) -> int:
        """K clamped so that the committed tokens and the K - 1 drafts fed after them fit in a slot."""
        length = len(request.token_ids)
        return min(request.num_speculative_tokens, self.runner.max_model_len - length + 1) if length else 0

    def _draftable(self, requests: Sequence[DraftRequest]) -> list[int]:
        """Indices of the requests to draft. A sequence that will never fit (too long, or ids the draft model
        does not have) also gives its slot back."""
        chosen, seen = [], set()
        for i, request in enumerate(requests):
            tokens = request.token_ids
            fits = len(tokens) <= self.runner.max_model_len and (
                not len(tokens) or (int(tokens.min()) >= 0 and int(tokens.max()) < self.runner.vocab_size)
            )
            if not fits:
                self.forget(request.seq_id)
            elif self._room(request) > 0 and request.seq_id not in seen:
                chosen.append(i)
                seen.add(request.seq_id)
        return chosen

    def _feed(self, request: DraftRequest) -> list[int]:
        """Set the slot's length to what it can keep of the committed tokens; returns the tokens to feed."""
        committed = request.token_ids
        keep = min(common_prefix_length(self.slots.tokens(request.seq_id), committed), len(committed) - 1)
        self.runner.truncate(request.seq_id, keep)
        return committed[keep:].tolist()

    def _draft_rows(self, seq_ids: list[Hashable], feeds: list[list[int]], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seq_ids]
        for batch in catch_up_batches([len(feed) for feed in feeds]):
            logits = self.runner.forward([RowInput(seq_ids[b], feeds[b], 1) for b in batch]).logits
            for b, token in zip(batch, logits[:, 0].argmax(dim=-1).tolist(), strict=True):
                drafts[b].append(int(token))
        for position in range(1, max(ks)):
            active = [b for b, k in enumerate(ks) if k > position]
            logits = self.runner.forward([RowInput(seq_ids[b], [drafts[b][-1]], 1) for b in active]).logits
            for b, token in zip(active, logits[:, 0].argmax(dim=-1).tolist(), strict=True):
                drafts[b].append(int(token))
        return drafts


def catch_up_batches(lengths: Sequence[int]) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped into catch-up forwards, longest first. In the steady state (every
    row feeds one or two tokens) that is one forward; a long prefill is batched only with rows that do not more
    than double its padded size (FREE_PADDING_TOKENS)."""
    batches: list[list[int]] = []
    width = real = 0
    for row in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        n = lengths[row]
        if batches:
            padded = (len(batches[-1]) + 1) * width
            if padded <= FREE_PADDING_TOKENS or padded <= 2 * (real + n):
                batches[-1].append(row)
                real += n
                continue
        batches.append([row])
        width, real = n, n
    return batches
