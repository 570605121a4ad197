"""Batch-invariant forwards: a token's logits are bit-identical whatever else its forward carries.

Why: a verify forward feeds K + 1 tokens a row beside other rows, a plain decode 1. Matrix kernels pick their
tiling (and so the order in which they add) by shape, so in bf16 the same token's logits differ in their last bits
between the two, and a near-tie can flip a greedy token: speculative greedy output then differs from
non-speculative output (issue 29 saw it on 30 of 64 chat requests on an H100; SmolLM2 on CPU in bf16 differs by
0.56 in a logit). In float32 the differences were too small to flip anything. vLLM answers with batch-invariant
kernels (VLLM_BATCH_INVARIANT), SGLang with --enable-deterministic-inference.

How, here: every forward runs as waves of one fixed shape (INVARIANT_ROWS rows x INVARIANT_WIDTH tokens x the
model's whole context as keys), each row feeding its next tokens, the rest padding; logits too are computed for the
whole fixed block. Every matrix product then has the same shape in every wave, and each row's result depends on its
own inputs only, so a token computes the same bits in a prefill chunk, a decode or a verify, alone or beside
others. The cost is the padding: a decode of one row pays for INVARIANT_ROWS x INVARIANT_WIDTH tokens, and a
long prompt is fed INVARIANT_WIDTH tokens a wave. On an accelerator each wave replays one captured graph, and
a small model's step is launch-bound, so the padding is nearly free there; on CPU it is not (the mode is off by
default). Token trees are fed as their first path in this mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INVARIANT_ROWS = 8
INVARIANT_WIDTH = 8  # a verify of up to 7 drafts is one wave


@dataclass(frozen=True)
class InvariantShape:
    rows: int
    width: int
    span: int  # key positions every wave reads: the whole context

    @classmethod
    def for_runner(cls, max_num_seqs: int, max_model_len: int, block_size: int) -> InvariantShape:
        span = -(-max_model_len // block_size) * block_size
        return cls(min(INVARIANT_ROWS, max_num_seqs), INVARIANT_WIDTH, span)

    @property
    def as_tuple(self) -> tuple[int, int, int]:
        return self.rows, self.width, self.span


Piece = tuple[int, int, int]  # (row index, first token, past the last token) fed in one wave


def waves(lengths: Sequence[int], shape: InvariantShape) -> list[list[Piece]]:
    """The forward's rows as waves of at most shape.rows pieces of at most shape.width tokens; a row's pieces
    follow each other in order, one per wave, so each sees the one before it in the cache."""
    offsets = [0] * len(lengths)
    result: list[list[Piece]] = []
    while any(offset < n for offset, n in zip(offsets, lengths, strict=True)):
        wave: list[Piece] = []
        for row, n in enumerate(lengths):
            if offsets[row] < n and len(wave) < shape.rows:
                stop = min(n, offsets[row] + shape.width)
                wave.append((row, offsets[row], stop))
        for row, _, stop in wave:
            offsets[row] = stop
        result.append(wave)
    return result
