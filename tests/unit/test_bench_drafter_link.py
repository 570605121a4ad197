"""The link bench's calls: each sequence grows by one token a call and, for a drafter that reads hidden states, carries
exactly one state row per token the target has run on (n - 1 for n tokens), as the verifier sends them."""

from __future__ import annotations

import asyncio

from services.bench.drafter_link import K, timed_calls
from services.common.proposer import Draft, ProposerCapabilities


class Recording:
    def __init__(self) -> None:
        self.calls = []

    async def propose(self, inputs):
        self.calls.append([(len(item.token_ids), None if item.hidden_states is None else
                            tuple(item.hidden_states.shape), item.num_speculative_tokens) for item in inputs])
        return [Draft([]) for _ in inputs]


def test_calls_grow_a_token_at_a_time_with_a_state_row_per_token_run():
    proposer = Recording()
    asyncio.run(timed_calls(proposer, rows=2, context=5, state_width=6, steps=3, warm_up=1))
    assert proposer.calls == [[(5 + step, (4 + step, 6), K)] * 2 for step in range(3)]
    plain = Recording()
    asyncio.run(timed_calls(plain, rows=1, context=5, steps=2, warm_up=0))
    assert plain.calls == [[(5, None, K)], [(6, None, K)]]


def test_the_state_width_is_the_layers_a_drafter_reads_side_by_side():
    eagle3 = ProposerCapabilities(vocab_size=10, needs_hidden_states=True, hidden_size=8, hidden_layers=(2, 5, -1))
    assert eagle3.state_width == 24
    assert ProposerCapabilities(vocab_size=10).state_width == 0
