"""The EAGLE bench's rows (services/bench/eagle_bench.py): each its own key, and the link's bytes per step counted
with the layers each drafter reads.

A full run wrote "eagle K=3: 5.99 KiB" on the link, three times its neighbours: the EAGLE-1 K = 3 row's key was
"eagle3", which read as an EAGLE-3 (three-layer) row.
"""

from __future__ import annotations

from services.bench.eagle_bench import EagleBenchSettings, link_bytes_per_step, modes
from services.bench.report import Generation, Measurement


def test_every_row_has_its_own_key_and_only_eagle3_rows_read_as_eagle3():
    rows = modes(EagleBenchSettings(eagle3_head="head"))
    assert len({mode.key for mode in rows}) == len(rows)
    assert {mode.key for mode in rows if mode.key.startswith("eagle3-")} == {
        mode.key for mode in rows if mode.method in ("eagle3", "eagle3-tree")}
    assert {(mode.method, mode.adaptive) for mode in rows if mode.method == "eagle3-tree"} == {
        ("eagle3-tree", False), ("eagle3-tree", True)}


def test_link_bytes_count_three_layers_for_eagle3_rows_only():
    generation = Generation(tokens=tuple(range(10)), seconds=1.0, num_steps=5)  # 2 tokens a step

    def measured(key: str, system: str) -> Measurement:
        return Measurement(f"{key}-1", "sharegpt", system, 1, ((generation,),))

    settings = EagleBenchSettings(ks=(3,), eagle3_head="head", eagle3_k=4)
    by_key = {mode.key: mode for mode in modes(settings)}
    line = link_bytes_per_step([measured("eagle-k3", by_key["eagle-k3"].system),
                                measured("eagle3-k4", by_key["eagle3-k4"].system)], hidden_size=512)
    assert line == "eagle K=3: 2.00 KiB; eagle3 K=4: 6.00 KiB"  # 2 tokens x 512 x 2 bytes, x 3 layers for EAGLE-3
