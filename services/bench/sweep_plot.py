"""The concurrency sweep as a figure: one column per workload, throughput on top, median inter-token latency below.

The best fixed K is drawn as one line through each point's winner (labelled with its K), because that is what
adaptive is measured against: no single fixed K is best everywhere, and each one alone is drawn faint behind it.
Agg backend, so it draws on a machine without a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.bench.sweep import PointStats, SweepRow


def _itl(point: PointStats) -> float:
    return math.nan if point.median_itl_ms is None else point.median_itl_ms


def _draw_workload(top, bottom, rows: Sequence[SweepRow]) -> None:
    x = [r.concurrency for r in rows]
    for axis, value in ((top, lambda p: p.tokens_per_s), (bottom, _itl)):
        for i, name in enumerate(p.mode for p in rows[0].fixed):
            axis.plot(x, [value(r.fixed[i]) for r in rows], color=f"C{i + 2}", alpha=0.3, linewidth=1,
                      marker=".", label=name)
        axis.plot(x, [value(r.none) for r in rows], color="0.35", linewidth=1.5, marker="o", label="none")
        best = [r.best_fixed for r in rows]
        axis.plot(x, [value(p) for p in best], color="C0", linestyle="--", linewidth=1.5, marker="s",
                  label="best fixed K")
        for xi, p in zip(x, best):
            axis.annotate(p.mode, (xi, value(p)), textcoords="offset points", xytext=(4, 4), fontsize=7,
                          color="C0")
        axis.plot(x, [value(r.adaptive) for r in rows], color="C1", linewidth=2.8, marker="D", label="adaptive")
        axis.set_xscale("log", base=2)
        axis.set_xticks(x, [str(c) for c in x])
        axis.minorticks_off()
        axis.margins(x=0.08)  # room for the K labels at the last point
        axis.grid(True, alpha=0.3)
    top.set_title(rows[0].workload)
    top.set_ylabel("throughput (tok/s)")
    bottom.set_ylabel("median inter-token latency (ms)")
    bottom.set_xlabel("concurrent requests")
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)


def draw_sweep(rows: Sequence[SweepRow], path: str | Path, title: str = "") -> None:
    """Write the figure to `path` (PNG), creating its folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    figure, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False, sharex="col")
    for column, workload in enumerate(workloads):
        _draw_workload(axes[0][column], axes[1][column], [r for r in rows if r.workload == workload])
    axes[0][0].legend(fontsize=8, loc="best")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
