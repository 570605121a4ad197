"""OpenAI's predicted outputs as drafts: a request that says what it expects its output to be, mostly (the file it
asks to edit, a document to revise), is drafted from that prediction wherever its output so far lines up with it.

Built into every engine under the method name "prediction" (a request's prediction goes with it in
SpeculationParams), so predicted outputs work without any drafter service and beside whatever the attached
drafters are. The drafts are deterministic and verified like any other, so the output is the target's as always:
a wrong prediction only costs the verification of drafts that are not accepted (adaptive speculation then drafts
fewer for it).

Lining up: the output's last n tokens (n from MAX_NGRAM down; the prompt is not the prediction's to match) are looked
for in the prediction. First where the last draft left off, moved on by the tokens committed since (the output
follows the prediction: the common case, a comparison of a few tokens); else the first occurrence from there on
(the output skipped part of the prediction: text deleted, or it rejoins the prediction after inserted text); else
the last occurrence before (text repeated). The longest n found wins, at least MIN_REJOIN tokens (one token in
common is mostly chance: a space, a bracket), unless the prompt and output themselves hold a longer match (a reply
that repeats itself); the tokens after the match are the draft. An output that has not begun yet lines up with the
prediction's start, one of one token with its first occurrence.

Where the output does not line up (a preamble before the code, an explanation after it, text the model writes
its own way), the request is drafted as the ngram method drafts, from its own prompt and output
(services/common/prompt_lookup.py): a prediction never leaves a request with fewer drafts than prompt lookup."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from services.common.drafter_methods import PREDICTION
from services.common.prompt_lookup import TOKEN_BYTES, NgramSettings, find_tokens, propose_ngram
from services.common.proposer import Draft, DraftInput, ProposerCapabilities

MAX_NGRAM = 8  # the longest suffix of the output looked for in the prediction
MIN_REJOIN = 2  # the shortest suffix that lines the output up again anywhere but where it left off
# K for a request with a prediction that does not set one, when the server's default is lower: a reply that lines
# up with its prediction takes long runs (make bench-prediction, 2-core EPYC: K = 8 2.90x none against K = 5's
# 2.73x on SmolLM2-135M, 6.16x against 5.70x on Qwen2.5-Coder-0.5B); adaptive speculation still verifies fewer
# where a wider verify does not pay
PREDICTION_NUM_TOKENS = 8


@dataclass
class _Alignment:
    """One sequence's prediction and where its output stood in it at the last draft."""

    prediction: np.ndarray  # int64
    data: bytes  # prediction's bytes, searched
    next_index: int = 0  # the index in prediction of the token expected after the committed ones
    committed: int | None = None  # how many output tokens were committed then (None: not lined up then)


@dataclass(frozen=True)
class LinedUp:
    """Where the output stands in the prediction: the index of the token expected next, and how many of the
    output's last tokens matched there (None: it went on from where it was, as the prediction has it)."""

    index: int
    matched: int | None


def line_up(output: np.ndarray, alignment: _Alignment) -> LinedUp | None:
    """Where in the prediction the output stands (see the module docstring), or None when no suffix of it long
    enough occurs in the prediction."""
    prediction, length = alignment.prediction, len(output)
    if length == 0:
        return LinedUp(0, None)
    if alignment.committed is not None:  # moved on by the tokens committed since the last draft
        expected = alignment.next_index + (length - alignment.committed)
        n = min(MAX_NGRAM, length, expected)
        if 0 < n and expected <= len(prediction) and np.array_equal(prediction[expected - n:expected], output[-n:]):
            return LinedUp(expected, None)
    data, here = alignment.data, alignment.next_index
    shortest = 1 if length == 1 else MIN_REJOIN
    for n in range(min(MAX_NGRAM, length, len(prediction)), shortest - 1, -1):
        pattern = np.ascontiguousarray(output[-n:], dtype=np.int64).tobytes()
        found = find_tokens(data, pattern, max(here - n, 0) * TOKEN_BYTES, len(data))
        if found < 0:
            found = find_tokens(data, pattern, 0, max(here - 1, 0) * TOKEN_BYTES + len(pattern), last=True)
        if found >= 0:
            return LinedUp(found + n, n)
    return None


class PredictionProposer:
    """Drafts each sequence from its request's prediction (DraftInput.prediction), and by prompt lookup where it
    does not line up with it; a sequence without a prediction gets no draft."""

    method = PREDICTION
    capabilities = ProposerCapabilities()  # copies token ids the gateway tokenized for this target: any vocabulary

    def __init__(self, lookup: NgramSettings | None = None) -> None:
        """lookup: how the requests are drafted where they do not line up with their prediction (ngram's
        defaults)."""
        self.lookup = lookup or NgramSettings()
        self._alignments: dict[Hashable, _Alignment] = {}

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [self._propose_one(item) for item in inputs]

    def release(self, seq_id: Hashable) -> None:
        self._alignments.pop(seq_id, None)

    def _propose_one(self, item: DraftInput) -> Draft:
        if not item.prediction or item.num_speculative_tokens <= 0:
            return Draft(())
        alignment = self._alignments.get(item.seq_id)
        if alignment is None:
            prediction = np.asarray(item.prediction, dtype=np.int64)
            alignment = self._alignments[item.seq_id] = _Alignment(prediction, prediction.tobytes())
        tokens, k = np.asarray(item.token_ids, dtype=np.int64), item.num_speculative_tokens
        place = line_up(tokens[item.num_prompt_tokens:], alignment)
        if place is not None and place.matched is not None:  # found again: the prompt and output themselves win
            longer = propose_ngram(tokens, k, NgramSettings(place.matched + 1, max(place.matched + 1, MAX_NGRAM)))
            if longer:  # where they hold a longer match than the prediction (a reply that repeats itself)
                alignment.committed = None
                return Draft(tuple(longer))
        if place is None or place.index >= len(alignment.prediction):  # off the prediction, or past its end
            alignment.committed = None  # search afresh next time
            return Draft(tuple(propose_ngram(tokens, k, self.lookup)))
        alignment.next_index, alignment.committed = place.index, len(tokens) - item.num_prompt_tokens
        return Draft(tuple(alignment.prediction[place.index:place.index + k].tolist()))
