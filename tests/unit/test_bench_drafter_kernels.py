"""The drafter-kernels bench end to end on the shipped EAGLE heads, one short round: both sides run, every row
comes out, and its baseline side really ran oneDNN's packed float32 kernels."""

from __future__ import annotations

import re

import pytest

from services.bench import drafter_kernels
from services.drafter.head_kernels import ChosenLinear

pytestmark = pytest.mark.slow


def test_both_sides_of_every_row_are_timed(capsys, monkeypatch):
    sides = []
    eagle_side = drafter_kernels.eagle_side

    def recording(config, chosen):
        proposer = eagle_side(config, chosen)
        sides.append((chosen, {m.kernel.choice.describe() for m in proposer.head.modules()
                               if isinstance(m, ChosenLinear)}))
        return proposer

    monkeypatch.setattr(drafter_kernels, "eagle_side", recording)
    assert drafter_kernels.main(["--repeats", "1", "--sequences", "1"]) == 0
    rows = re.findall(r"^\| (EAGLE-.*?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", capsys.readouterr().out, re.M)
    assert [label for label, *_ in rows] == ["EAGLE-1 chain of 4, ask of 1 sequence(s)",
                                             "EAGLE-3 tree of 24 (top-8, depth 4), ask of 1 sequence(s)"]
    assert all(float(before) > 0 and float(after) > 0 for _, before, after, _ in rows)
    baselines = [described for chosen, described in sides if not chosen]
    assert len(baselines) == 2 and all(described == {"packed at all M"} for described in baselines)
