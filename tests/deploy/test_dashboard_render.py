"""The dashboard renderer (services/dashboard/render.py) against the real dashboard JSON, without Prometheus:
every panel query gets its variables filled in, and every panel is drawn where its gridPos puts it, titled,
with its series named by legendFormat and its unit on the y axis. (The queries' results against a real
Prometheus are tests/e2e/test_prometheus_metrics.py's.)"""

from __future__ import annotations

import math

import pytest

from services.dashboard import render
from services.dashboard.render import Series, legend, load_dashboard, match_all, panel_queries, substitute


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def test_every_query_is_substituted_with_match_all_values(dashboard):
    values = match_all(dashboard, "4s")
    assert values == {"model": ".*", "method": ".*", "instance": ".*", "__rate_interval": "4s"}
    panels = render.timeseries_panels(dashboard)
    assert len(panels) == 18 and len(dashboard["panels"]) == 22  # and 4 rows
    for panel in panels:
        queries = panel_queries(panel, values)
        assert len(queries) == len(panel["targets"]) >= 1, panel["title"]
        for expr, legend_format in queries:
            assert "$" not in expr, expr
            assert "[4s]" in expr or "rate(" not in expr, expr
            assert legend_format, panel["title"]


def test_substitution_refuses_unknown_variables_and_fills_both_spellings():
    assert substitute('x{a=~"$model", b=~"${method}"}[$__rate_interval]',
                      {"model": ".*", "method": "ngram", "__rate_interval": "1m"}) == 'x{a=~".*", b=~"ngram"}[1m]'
    with pytest.raises(KeyError):
        substitute("rate(x[$__interval])", {"__rate_interval": "1m"})


def test_legend_fills_labels_like_grafana():
    assert legend("{{method}} position {{ position }}", {"method": "ngram", "position": "2"}) == "ngram position 2"
    assert legend("p90 {{method}}", {}) == "p90"
    assert legend("", {"job": "verifier", "a": "1"}) == '{a="1", job="verifier"}'


def test_fetch_runs_every_query_as_a_range_query(dashboard, monkeypatch):
    sent = []

    def fake_query_range(url, expr, start, end, step_s):
        sent.append((url, expr, start, end, step_s))
        return [{"metric": {"method": "ngram", "model_name": "m", "position": "0", "kind": "verify",
                            "drafter": "ngram", "finished_reason": "stop", "endpoint": "/v1/completions",
                            "status": "200", "instance": "h:1"},
                 "values": [[100, "1"], [102, "NaN"], [104, "+Inf"], [106, "0.5"]]}]

    monkeypatch.setattr(render, "query_range", fake_query_range)
    series = render.fetch("http://prom", dashboard, 100, 106, 2, "8s")
    targets = sum(len(p["targets"]) for p in render.timeseries_panels(dashboard))
    assert len(sent) == targets and {s[0] for s in sent} == {"http://prom"}
    assert {s[2:] for s in sent} == {(100, 106, 2)}
    assert all("$" not in expr for _, expr, *_ in sent)
    by_title = {p["title"]: series[p["id"]] for p in render.timeseries_panels(dashboard)}
    (position,) = by_title["Acceptance by draft position"]
    assert position.name == "ngram position 0" and position.times == [100, 102, 104, 106]
    assert position.values[0] == 1 and math.isnan(position.values[1]) and math.isnan(position.values[2])
    assert [s.name for s in by_title["Time to first token"]] == ["p50 ngram", "p90 ngram", "p99 ngram"]


def test_every_panel_is_drawn_in_its_grid_place(dashboard, tmp_path):
    panels = render.timeseries_panels(dashboard)
    empty = panels[-1]
    series = {p["id"]: [Series(f"{p['title']} a", [1e9, 1e9 + 60], [0.2, 0.4])] for p in panels[:-1]}
    out = tmp_path / "dashboard.png"
    axes = render.draw(dashboard, series, out, "subtitle")
    assert out.stat().st_size > 10_000
    assert set(axes) == {p["title"] for p in dashboard["panels"]}
    for panel in dashboard["panels"]:
        ax = axes[panel["title"]]
        if panel["type"] == "row":
            assert [t.get_text() for t in ax.texts] == [panel["title"]] and not ax.axison
            continue
        assert ax.get_title(loc="left") == panel["title"]
        if panel is empty:
            assert not ax.lines and [t.get_text() for t in ax.texts] == ["No data"]
        else:
            assert [line.get_label() for line in ax.lines] == [f"{panel['title']} a"]
            assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"{panel['title']} a"]
    # gridPos: same y -> same top; more x -> further right; w/24 of the width (wspace aside); more y -> lower.
    boxes = {p["title"]: (p["gridPos"], axes[p["title"]].get_position()) for p in panels}
    for (pos_a, box_a) in boxes.values():
        for (pos_b, box_b) in boxes.values():
            if pos_a["y"] == pos_b["y"]:
                assert box_a.y1 == pytest.approx(box_b.y1)
                assert (pos_a["x"] < pos_b["x"]) == (box_a.x0 < box_b.x0)
            if pos_a["y"] < pos_b["y"]:
                assert box_a.y0 > box_b.y1
    full_width = 0.99 - 0.04
    for pos, box in boxes.values():
        assert box.width == pytest.approx(full_width * pos["w"] / 24, rel=0.15)


def test_units_follow_field_config(dashboard, tmp_path):
    axes = render.draw(dashboard, {}, tmp_path / "d.png")
    for panel in render.timeseries_panels(dashboard):
        defaults = panel["fieldConfig"]["defaults"]
        formatter = axes[panel["title"]].yaxis.get_major_formatter()
        expected = {"percentunit": "50%", "s": "500 ms", "reqps": "0.5 req/s"}.get(defaults["unit"], "0.5")
        assert formatter(0.5, 0) == expected, panel["title"]
        if "max" in defaults:
            assert axes[panel["title"]].get_ylim() == (defaults["min"], defaults["max"])
