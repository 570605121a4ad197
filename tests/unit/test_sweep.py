"""The concurrency sweep: its arithmetic (inter-token latency, best fixed K, targets, tables) on hand-made numbers,
and the whole pipeline on a tiny random llama (token ids in directly: no tokenizer, no download)."""

from __future__ import annotations

import math
import random

import pytest

from services.bench.prompts import Workload
from services.bench.sweep import (
    BatchRun,
    PointStats,
    RequestTrace,
    SweepRow,
    SweepSettings,
    batch_prompts,
    best_fixed,
    equality_checks,
    format_acceptance_table,
    format_report,
    format_throughput_table,
    int_list,
    median_itl_s,
    parse_args,
    run_sweep,
    sweep_modes,
    sweep_rows,
    sweep_targets,
    token_gaps,
)
from tests.prompts import repetitive_prompt
from tests.tiny_models import tiny_llama


def point(mode: str, tokens_per_s: float, concurrency: int = 1, workload: str = "humaneval",
          itl: float | None = 10.0, accepted: float | None = None) -> PointStats:
    return PointStats(workload, concurrency, mode, tokens_per_s, itl, accepted, 100)


def row(none: float, fixed: dict[str, float], adaptive: float, concurrency: int = 1,
        workload: str = "humaneval") -> SweepRow:
    return SweepRow(
        workload, concurrency, point("none", none, concurrency, workload),
        tuple(point(m, v, concurrency, workload) for m, v in fixed.items()),
        point("adaptive", adaptive, concurrency, workload),
    )


# -- inter-token latency ---------------------------------------------------------------------------------------


def test_token_gaps_skip_the_first_chunk_and_split_a_chunk_over_its_tokens():
    # chunks at 1.0 s (3 tokens: time to first token, skipped), 1.1 s (1 token), 1.4 s (3 tokens)
    gaps = token_gaps([1.0, 1.1, 1.4], [3, 1, 3])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert token_gaps([0.5], [4]) == []
    assert token_gaps([], []) == []


def test_median_itl_is_over_every_token_of_every_request():
    a = RequestTrace((1, 2, 3), (0.0, 0.01, 0.02), (1, 1, 1))  # two gaps of 10 ms
    b = RequestTrace((1, 2, 3, 4, 5), (0.0, 0.1), (1, 4))  # four tokens of 25 ms
    assert median_itl_s([a, b]) == pytest.approx(0.025)  # [10, 10, 25, 25, 25, 25] ms
    assert median_itl_s([RequestTrace((1,), (0.3,), (1,))]) is None  # a single chunk has no gap


# -- best fixed K, ratios, targets -----------------------------------------------------------------------------


def test_best_fixed_is_the_fastest_and_the_first_listed_on_a_tie():
    assert best_fixed([point("K=2", 10), point("K=4", 14), point("K=8", 12)]).mode == "K=4"
    assert best_fixed([point("K=2", 14), point("K=4", 14)]).mode == "K=2"
    r = row(20, {"K=2": 30, "K=4": 40}, 38)
    assert r.best_fixed.mode == "K=4"
    assert r.adaptive_vs_none == pytest.approx(1.9) and r.adaptive_vs_best_fixed == pytest.approx(0.95)


def test_sweep_rows_group_points_by_workload_then_concurrency():
    points = [point(m, v, c, w) for w in ("humaneval", "code-edit") for c in (4, 1)
              for m, v in (("none", 10), ("K=2", 11), ("K=4", 12), ("adaptive", 13))]
    rows = sweep_rows(points, ("K=2", "K=4"))
    assert [(r.workload, r.concurrency) for r in rows] == [
        ("humaneval", 1), ("humaneval", 4), ("code-edit", 1), ("code-edit", 4)
    ]
    assert [p.mode for p in rows[0].fixed] == ["K=2", "K=4"] and rows[0].adaptive.mode == "adaptive"


def test_targets_met():
    rows = [row(20, {"K=2": 30, "K=4": 40}, 38, 1), row(80, {"K=2": 70, "K=4": 60}, 82, 8)]
    lines = [t.line() for t in sweep_targets(rows)]
    assert lines == [
        "adaptive >= 0.98x none at every point: met (min 1.025x at humaneval, 8 requests)",
        "adaptive >= 0.9x best fixed K at 1 request: met (humaneval 0.950x of K=4)",
    ]


def test_targets_not_met_name_the_worst_point():
    rows = [row(20, {"K=2": 30, "K=4": 40}, 30, 1, "code-edit"), row(80, {"K=2": 70}, 76, 16, "humaneval")]
    first, second = sweep_targets(rows)
    assert first.met is False and "min 0.950x at humaneval, 16 requests" in first.line()
    assert second.met is False and second.line().endswith("not met (code-edit 0.750x of K=4)")


def test_the_single_request_target_is_not_measured_without_concurrency_1():
    targets = sweep_targets([row(80, {"K=2": 70}, 81, 4)])
    assert targets[0].met is True
    assert targets[1].met is None and "not measured" in targets[1].line()


# -- equality checks and tables --------------------------------------------------------------------------------


def test_equality_checks_compare_every_round_of_a_mode_with_none_request_by_request():
    def run(mode, outputs, round_number=0):
        return BatchRun("humaneval", 2, mode, round_number, 1.0,
                        tuple(RequestTrace(tuple(o), (0.0,), (len(o),)) for o in outputs))

    runs = [run("none", [[1, 2], [3, 4]]), run("K=2", [[1, 2], [3, 4]]), run("adaptive", [[1, 2], [3, 5]]),
            run("none", [[1, 2], [3, 4]], 1), run("K=2", [[1, 2], [3, 4]], 1), run("adaptive", [[1, 2], [3, 4]], 1)]
    checks = {c.mode: c for c in equality_checks(runs)}
    assert set(checks) == {"K=2", "adaptive"}
    assert (checks["K=2"].mismatches, checks["K=2"].total) == (0, 4)
    assert (checks["adaptive"].mismatches, checks["adaptive"].total) == (1, 4)
    assert checks["K=2"].line() == "greedy K=2 vs none [humaneval, 2 concurrent]: identical (4 outputs)"
    assert "1/4 DIFFER" in checks["adaptive"].line()


def test_throughput_table_has_a_row_per_concurrency_and_the_ratio_columns():
    rows = [row(20, {"K=2": 30, "K=4": 40}, 38, 1), row(80, {"K=2": 70, "K=4": 60}, 81, 8)]
    table = format_throughput_table(rows).splitlines()
    assert table[0] == ("| req | none tok/s | K=2 tok/s | K=4 tok/s | adaptive tok/s | best fixed | adaptive/none | "
                        "adaptive/best fixed | ITL none ms | ITL best fixed ms | ITL adaptive ms |")
    assert table[1] == "|---|" + "---:|" * 10
    assert table[2] == "| 1 | 20.0 | 30.0 | 40.0 | 38.0 | K=4 | 1.90x | 0.95x | 10.0 | 10.0 | 10.0 |"
    assert table[3] == "| 8 | 80.0 | 70.0 | 60.0 | 81.0 | K=2 | 1.01x | 1.16x | 10.0 | 10.0 | 10.0 |"


def test_acceptance_table_shows_a_dash_where_nothing_was_drafted():
    r = SweepRow("humaneval", 1, point("none", 10), (point("K=2", 10, accepted=1.25),),
                 point("adaptive", 10, accepted=None))
    assert format_acceptance_table([r]).splitlines()[2] == "| 1 | 1.25 | - |"


def test_command_line_defaults_and_quick():
    full = parse_args([])
    assert (full.concurrency, full.fixed_k, full.num_prompts, full.max_tokens, full.edit_max_tokens) == (
        (1, 4, 8, 16), (2, 4, 8), 16, 128, 256)
    assert full.png == "docs/concurrency_sweep.png" and full.method == "ngram"
    quick = parse_args(["--quick"])
    assert (quick.concurrency, quick.fixed_k, quick.num_prompts, quick.max_tokens, quick.edit_max_tokens) == (
        (1, 2), (2, 4), 2, 16, 32)
    assert quick.png == ""  # a toy run does not overwrite the committed figure
    assert int_list("1, 4,8") == (1, 4, 8)
    assert [m.name for m in sweep_modes((2, 4, 8))] == ["none", "K=2", "K=4", "K=8", "adaptive"]
    assert sweep_modes((2, 4, 8))[-1].k == 8 and sweep_modes((2, 4, 8))[-1].adaptive
    assert batch_prompts([(1,), (2,)], 3) == [(1,), (2,), (1,)]


# -- end to end on a tiny model --------------------------------------------------------------------------------


def test_sweep_end_to_end_on_a_tiny_model(tmp_path):
    model = tiny_llama(seed=5)
    model.generation_config.eos_token_id = None
    rng = random.Random(0)
    workloads = [
        Workload("humaneval", tuple(repetitive_prompt(rng, n) for n in (12, 20, 16)), max_tokens=10),
        Workload("code-edit", (repetitive_prompt(rng, 30), repetitive_prompt(rng, 24)), max_tokens=14),
    ]
    settings = SweepSettings(concurrency=(1, 3), fixed_k=(2, 4), prompt_lookup_min=1, prompt_lookup_max=3,
                             repeats=2, compute_thread="worker")
    messages: list[str] = []

    result = run_sweep(model, workloads, settings, [], {"model": "tiny llama"}, messages.append)

    assert messages
    modes = ("none", "K=2", "K=4", "adaptive")
    assert len(result.runs) == 2 * 2 * len(modes) * 2  # rounds x workloads x modes x concurrencies
    for run in result.runs:
        w = next(w for w in workloads if w.name == run.workload)
        assert len(run.requests) == run.concurrency
        assert all(len(r.tokens) == w.max_tokens == sum(r.chunk_sizes) for r in run.requests)  # no EOS
        assert all(list(r.chunk_times) == sorted(r.chunk_times) for r in run.requests)
    assert result.failed_checks == 0, [c for c in result.checks if c.mismatches]
    assert len(result.checks) == 2 * 2 * 3  # workloads x concurrencies x speculative modes
    rows = result.rows
    assert [(r.workload, r.concurrency) for r in rows] == [
        ("humaneval", 1), ("humaneval", 3), ("code-edit", 1), ("code-edit", 3)
    ]
    for r in rows:
        for p in (r.none, *r.fixed, r.adaptive):
            assert p.tokens_per_s > 0 and p.median_itl_ms is not None and p.median_itl_ms > 0
        assert r.none.accepted_per_draft is None
        assert math.isfinite(r.adaptive_vs_none)
    assert any(p.accepted_per_draft for r in rows for p in r.fixed), "n-gram drafted on the repetitive prompts"

    report = format_report(result)
    for heading in ("### humaneval", "### code-edit", "### Targets", "### Greedy equality"):
        assert heading in report
    assert "adaptive >= 0.98x none at every point: " in report
    assert "specserve compute thread: worker (forced)" in report
    assert result.to_json()["runs"]

    from services.bench.sweep_plot import draw_sweep

    png = tmp_path / "sweep.png"
    draw_sweep(rows, png, title="tiny")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
