"""A drafter that costs what an accelerator's EAGLE drafter costs and drafts the script as well as one does: the
EAGLE rows of the engine-host-cost bench (`--method eagle-sim`), with the model taken out.

On the H200 (stop 53) an EAGLE-3 ask over gRPC took about 3 ms at one sequence and 4.5 at eight, against a 2.4 ms
captured step, and EAGLE read 0.43-0.98x no speculation: whether the planner can make such a drafter pay, and what
it costs the steps it does not ask (the target's hidden states are kept for it at every step), are questions about
the engine's host work and its planner, which a CPU can answer once the ask's time is given. So this proposer:
- declares `needs_hidden_states`, so the engine keeps every row's states each step as it does for EAGLE (the
  scripted runner returns states of the width given, as SmolLM2's EAGLE-3 layers are 3 x 576 wide);
- takes `SimulatedAsk.seconds(rows, opened)` per call, slept on a thread of its own (the loop stays free, as it is
  while a remote drafter computes), `opened` being the sequences it is asked about for the first time (EAGLE's
  opening: the prompt's states through the head; on an H200 an opening call of 52 chats took 14-29 ms in process
  against 7-11 for a later ask of them, stop 74);
- drafts the script's next tokens, each position right with probability `accept` given the one before was
  (EAGLE-3 on chat: about 2 tokens a step at K = 4 on CPU, i.e. an accepted draft of about 1), decided by a hash of
  the request's salt and the position, so runs repeat; a wrong token is the script's next token shifted by one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.bench.scripted_model import Script, mix
from services.common.proposer import Draft, DraftInput, ProposerCapabilities


@dataclass(frozen=True)
class SimulatedAsk:
    """An ask's wall time, the link included: `base_ms` + `row_ms` a sequence beyond the first (the H200's EAGLE-3
    chain of 4 over gRPC, stop 53: about 3.0 ms at 1 sequence, 4.5 at 8)."""

    base_ms: float = 3.0
    row_ms: float = 0.2
    opening_ms: float = 0.0  # more for each sequence asked about for the first time

    def seconds(self, rows: int, opened: int = 0) -> float:
        return (self.base_ms + self.row_ms * (rows - 1) + self.opening_ms * opened) / 1000.0


@dataclass(frozen=True)
class EagleLike:
    """The settings of a ScriptedDrafter: its ask's time, the chance a draft position is right given the one before
    was, and the width of the target states it reads a token."""

    ask: SimulatedAsk = SimulatedAsk()
    accept: float = 0.55
    state_width: int = 1728
    repeating_accept: float | None = None  # the chance on a request that repeats (mixed text); None: `accept`

    def drafter(self, script: Script) -> ScriptedDrafter:
        return ScriptedDrafter(script, self.ask, self.accept, self.state_width, self.repeating_accept)


class ScriptedDrafter:
    """The proposer the module docstring describes (in process; `close` stops its sleeper thread)."""

    def __init__(self, script: Script, ask: SimulatedAsk, accept: float = 0.55, state_width: int = 1728,
                 repeating_accept: float | None = None) -> None:
        """repeating_accept: the chance a position is right on a request that repeats (a code edit among the chats
        of mixed text, as a drafter guesses an edit's copied text better than new chat); None: `accept`."""
        repeating_accept = accept if repeating_accept is None else repeating_accept
        for name, value in (("accept", accept), ("repeating_accept", repeating_accept)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.script = script
        self.ask = ask
        self.accept = accept
        self.repeating_accept = repeating_accept
        self.capabilities = ProposerCapabilities(needs_hidden_states=True, hidden_size=state_width)
        self._sleeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scripted-drafter")
        self._open: set[Hashable] = set()  # the sequences asked about so far (until released)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        opened = {item.seq_id for item in inputs} - self._open
        self._open |= opened
        await asyncio.get_running_loop().run_in_executor(self._sleeper, time.sleep,
                                                         self.ask.seconds(len(inputs), len(opened)))
        return [Draft(self.draft(item.token_ids, item.num_speculative_tokens)) for item in inputs]

    def draft(self, committed: Sequence[int], k: int) -> list[int]:
        """k tokens after `committed`: the script's while each position's draw says right, then wrong ones (the
        script's shifted by one; never accepted, the verifier stops at the first)."""
        salt, start = self.script.salt_of(committed), len(committed)
        accept = self.repeating_accept if self.script.repeats(salt) else self.accept
        tokens, right = [], True
        for position in range(start, start + k):
            token = self.script.token(position, salt)
            right = right and mix(position * 7 + salt * 1_000_033 + 3) % 10_000 < accept * 10_000
            tokens.append(token if right else (token + 1) % self.script.vocab)
        return tokens

    def release(self, seq_id: Hashable) -> None:
        self._open.discard(seq_id)

    def close(self) -> None:
        self._sleeper.shutdown(wait=False)
