"""Draw the Grafana dashboard from a Prometheus server, without Grafana: every timeseries panel's queries run as
range queries over a time window, with the template variables set to All (their `allValue`, a match-all regex)
and `$__rate_interval` to a fixed window, and the panels are drawn with matplotlib in the dashboard's own grid
(`gridPos`, 24 columns; row panels become section titles), titled, with series named by `legendFormat` and the
y axis in the panel's unit (`fieldConfig.defaults`: unit, min, max).

    python -m services.dashboard.render --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from services.dashboard.prometheus import query_range

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "specserve" / "dashboards" / "specserve.json"
GRID_COLUMNS = 24
# In the picture, a grid unit (30 px in Grafana) is cut into SUBUNITS rows: a panel's title takes the first
# TITLE_SUBUNITS, its tick labels and legend the last LEGEND_SUBUNITS; a row's title takes ROW_HEIGHT units.
SUBUNITS = 4
TITLE_SUBUNITS = 2
LEGEND_SUBUNITS = 9
ROW_HEIGHT = 1.6
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# Grafana's classic palette, in its order.
COLORS = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0", "#508642",
          "#CCA300")


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with `$name` and `${name}` replaced from `values`; an unknown variable is a KeyError (Grafana
    would send it unreplaced)."""
    return VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def match_all(dashboard: dict, rate_interval: str) -> dict[str, str]:
    """Every query variable at All (its allValue, else Grafana's default regex) and `$__rate_interval`."""
    values = {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"] if v["type"] == "query"}
    return {**values, "__rate_interval": rate_interval}


def legend(legend_format: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana writes it: `{{label}}` filled in; without a format, the label set."""
    if legend_format:
        return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend_format).strip()
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def timeseries_panels(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] == "timeseries"]


def panel_queries(panel: dict, values: dict[str, str]) -> list[tuple[str, str]]:
    """(PromQL as sent, legendFormat) for each of the panel's targets."""
    return [(substitute(t["expr"], values), t.get("legendFormat", "")) for t in panel["targets"] if t.get("expr")]


@dataclass
class Series:
    name: str
    times: list[float]  # Unix seconds
    values: list[float]  # NaN where Prometheus had no value or a non-finite one (a gap in the line)

    @property
    def has_data(self) -> bool:
        return any(math.isfinite(v) for v in self.values)


def fetch(url: str, dashboard: dict, start: float, end: float, step_s: float,
          rate_interval: str) -> dict[int, list[Series]]:
    """Panel id -> its series over [start, end], every query run as a range query."""
    values = match_all(dashboard, rate_interval)
    drawn = {}
    for panel in timeseries_panels(dashboard):
        series = []
        for expr, legend_format in panel_queries(panel, values):
            for result in query_range(url, expr, start, end, step_s):
                points = [(float(t), float(v)) for t, v in result["values"]]
                series.append(Series(legend(legend_format, result["metric"]), [t for t, _ in points],
                                     [v if math.isfinite(v) else math.nan for _, v in points]))
        drawn[panel["id"]] = series
    return drawn


def _unit_formatter(unit: str | None):
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    if unit == "percentunit":
        return PercentFormatter(xmax=1, decimals=0)
    if unit == "s":
        return FuncFormatter(_seconds)
    if unit == "reqps":
        return FuncFormatter(lambda v, _: f"{v:g} req/s")
    return FuncFormatter(lambda v, _: f"{v:g}")  # short, none


def _seconds(value: float, _position=None) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        return f"{value * 1e6:.3g} µs"
    return f"{value * 1e3:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"


def grid_heights(dashboard: dict) -> list[float]:
    """Relative height of each subunit of the grid, top to bottom (a row's title is taller than in Grafana)."""
    units = [1.0] * max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            units[panel["gridPos"]["y"]] = ROW_HEIGHT
    return [unit for unit in units for _ in range(SUBUNITS)]


def draw(dashboard: dict, series: dict[int, list[Series]], out: Path, subtitle: str = "",
         width_in: float = 18.0, height_in: float = 24.0, dpi: int = 70) -> dict[str, object]:
    """Draw the panels in their grid into `out` (PNG); returns panel title -> its matplotlib axes (rows: the
    title's text axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from PIL import Image

    figure = plt.figure(figsize=(width_in, height_in), dpi=dpi)
    heights = grid_heights(dashboard)
    grid = figure.add_gridspec(len(heights), GRID_COLUMNS, height_ratios=heights, left=0.04, right=0.99,
                               top=0.965, bottom=0.0, wspace=5, hspace=0)
    figure.suptitle(dashboard["title"], x=0.04, ha="left", fontsize=20, fontweight="bold")
    if subtitle:
        figure.text(0.99, 0.985, subtitle, ha="right", va="top", fontsize=12, color="#555555")
    axes = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        top, bottom = pos["y"] * SUBUNITS, (pos["y"] + pos["h"]) * SUBUNITS
        columns = slice(pos["x"], pos["x"] + pos["w"])
        if panel["type"] == "row":
            ax = figure.add_subplot(grid[top:bottom, columns])
            ax.axis("off")
            ax.text(0, 0.1, panel["title"], fontsize=17, fontweight="bold", va="bottom")
            axes[panel["title"]] = ax
            continue
        ax = figure.add_subplot(grid[top + TITLE_SUBUNITS:bottom - LEGEND_SUBUNITS, columns])
        axes[panel["title"]] = ax
        _draw_panel(ax, panel, series.get(panel["id"], []), mdates)
    out.parent.mkdir(parents=True, exist_ok=True)
    picture = io.BytesIO()
    figure.savefig(picture, dpi=dpi)
    plt.close(figure)
    # A 256-colour palette: the same picture at about half the bytes of matplotlib's RGBA PNG.
    Image.open(picture).convert("RGB").quantize(colors=256).save(out, optimize=True)
    return axes


def _draw_panel(ax, panel: dict, series: list[Series], mdates) -> None:
    from matplotlib.transforms import offset_copy

    defaults = (panel.get("fieldConfig") or {}).get("defaults", {})
    custom = defaults.get("custom", {})
    ax.set_title(panel["title"], loc="left", fontsize=14, fontweight="bold")
    ax.grid(True, color="#e5e5e5", linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=11)
    ax.yaxis.set_major_formatter(_unit_formatter(defaults.get("unit")))
    locator = mdates.AutoDateLocator(minticks=3, maxticks=7)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, show_offset=False))
    shown = [s for s in series if s.has_data]
    for index, s in enumerate(shown):
        color = COLORS[index % len(COLORS)]
        times = [datetime.fromtimestamp(t) for t in s.times]
        ax.plot(times, s.values, color=color, linewidth=custom.get("lineWidth", 1) + 0.5, label=s.name)
        ax.fill_between(times, s.values, color=color, alpha=custom.get("fillOpacity", 0) / 100, linewidth=0)
    if not shown:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", fontsize=14,
                color="#888888")
    if "min" in defaults or "max" in defaults:
        ax.set_ylim(defaults.get("min"), defaults.get("max"))
    elif shown:
        ax.set_ylim(bottom=0)
    if shown:
        below_ticks = offset_copy(ax.transAxes, ax.figure, y=-20, units="points")
        columns = 3 if max(len(s.name) for s in shown) <= 14 else 2
        ax.legend(loc="upper left", bbox_to_anchor=(0, 0), bbox_transform=below_ticks, ncol=columns,
                  fontsize=10, frameon=False, handlelength=1.2, columnspacing=1.2, borderaxespad=0,
                  labelspacing=0.25)


def render(url: str, start: float, end: float, out: Path, rate_interval: str, step_s: float | None = None,
           dashboard: dict | None = None, dpi: int = 70) -> dict[int, list[Series]]:
    """Query `url` over [start, end] and draw the dashboard into `out`; returns what was drawn."""
    dashboard = dashboard or load_dashboard()
    step_s = step_s or max(1.0, round((end - start) / 300))
    series = fetch(url, dashboard, start, end, step_s, rate_interval)
    window = f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(end):%H:%M:%S}"
    draw(dashboard, series, out, f"{window}; Model, Method, Instance: All; $__rate_interval = {rate_interval}",
         dpi=dpi)
    return series


def summary(dashboard: dict, series: dict[int, list[Series]]) -> list[str]:
    """One line per panel: its series, and whether any is non-zero."""
    lines = []
    for panel in timeseries_panels(dashboard):
        shown = [s for s in series.get(panel["id"], []) if s.has_data]
        peak = max((max(v for v in s.values if math.isfinite(v)) for s in shown), default=None)
        state = "NO DATA" if not shown else "all zero" if peak == 0 else f"peak {peak:.3g}"
        lines.append(f"{panel['title']}: {len(shown)} series, {state}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.dashboard.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=15.0, help="window ending now (unless --end)")
    parser.add_argument("--start", type=float, help="window start, Unix seconds")
    parser.add_argument("--end", type=float, help="window end, Unix seconds (default now)")
    parser.add_argument("--rate-interval", default="15s", help="what $__rate_interval stands for (default 15s)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--dpi", type=int, default=70)
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    end = args.end or time.time()
    start = args.start or end - args.minutes * 60
    dashboard = load_dashboard(args.dashboard)
    series = render(args.prometheus, start, end, args.out, args.rate_interval, dashboard=dashboard, dpi=args.dpi)
    print("\n".join(summary(dashboard, series)))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
