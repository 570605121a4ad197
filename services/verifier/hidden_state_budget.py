"""How much of each sequence's backlog of target hidden states one Draft step sends to an EAGLE drafter.

A sequence's first step sends the states of its whole prompt, and a batch of long prompts that start decoding
together sends them all at once: 4 prompts of 1,800 tokens of SmolLM2's 576-wide states made a 6.2 MB message,
past gRPC's 4 MiB default, and the drafter broke the stream for every request; a 7B target's 4,096-wide states
are 8 KiB a token, three layers of them for EAGLE-3. The step's states are capped instead: a sequence whose rows
do not fit in what is left sends what does (its drafter catches up over a few steps, drafting nothing meanwhile,
as when a drafter is late), and the next steps send the rest. The first sequence of a step always gets at least
one row, so every backlog drains whatever the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_VALUE = 2  # states cross the link as float16


@dataclass
class HiddenStateBudget:
    bytes_left: int
    spent: bool = False

    def take(self, held: int, committed: int, width: int) -> int:
        """How many committed tokens a drafter holding `held` of a sequence's `committed` tokens (and the states
        of all but the last it holds) can hold after this step: `committed` when the missing rows of `width`
        values fit, fewer otherwise; their rows are spent."""
        held_rows = max(held - 1, 0)
        missing = max(committed - 1 - held_rows, 0)
        row_bytes = width * BYTES_PER_VALUE
        fitting = self.bytes_left // row_bytes if row_bytes else missing
        if not self.spent:
            fitting = max(fitting, 1)
        rows = min(missing, fitting)
        self.bytes_left -= rows * row_bytes
        self.spent = self.spent or rows > 0
        return committed if rows == missing else held_rows + rows + 1
