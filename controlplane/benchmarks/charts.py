"""Plotly charts of benchmark results: latency and goodput against load, and quality against cost.

A run is drawn in its tier's colour, as the tier is on every chart. What one run draws several
of is told apart within that colour: runs of a chart by dash (the first solid), and request
classes, tasks and measures by marker; a run's latency quantiles by dash, as only one run draws
more than one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import plotly.graph_objects as go

from controlplane.benchmarks.scoring import METRIC_NAMES, TASKS, headline
from controlplane.benchmarks.workload import CLASS_NAMES
from controlplane.web.charts import (
    COUNT_AXIS,
    DASHES,
    MARGIN,
    MEASURE_AXIS,
    SYMBOLS,
    colour_of,
    figure_html,
    money_axis,
)

_DASH = {"p50": "dot", "p90": "dash", "p99": "solid"}
ACCURACY_AXIS = {"range": [0, 1.05], "tickformat": ".0%"}
NO_LOAD_RESULTS = "No stage has finished yet."
NO_SWEEP_RESULTS = "No pixel cap has finished yet."


@dataclass(frozen=True)
class Run:
    """One run as a chart draws it: its name in the legend, its results and its tier's name."""

    name: str
    results: dict
    tier: str

    @classmethod
    def of(cls, run, name: str = "") -> Run:
        """A BenchmarkRun (its profile's tier read with it) under `name`, its own by default; of
        the tier it ran on, even if its profile has moved to another since."""
        tier = (run.config or {}).get("tier", {}).get("name") or run.profile.tier.name
        return cls(name or str(run), run.results or {}, tier)


def _axis(results: dict) -> str:
    return "concurrency" if results.get("arrival") == "closed" else "offered load (requests/s)"


def _style(colour: str, *, dash: str = "solid", symbol: str = SYMBOLS[0]) -> dict:
    return {"line": {"color": colour, "dash": dash}, "marker": {"color": colour, "symbol": symbol}}


def _prefixed(run: Run, label: str, runs: list[Run]) -> str:
    """A series' legend name: the run's name before it when the chart draws several runs."""
    return f"{run.name}: {label}" if len(runs) > 1 else label


def latency_chart(runs: list[Run], *, metric: str = "ttft", quantiles=("p50", "p99"),
                  div_id: str = "latency-chart", colours: Mapping[str, str] | None = None) -> str:
    """One line per run, request class and quantile: `metric` (ms) at each load level."""
    figure = go.Figure()
    for n, run in enumerate(runs):
        stages = run.results.get("stages") or []
        classes = sorted({k for stage in stages for k in stage["classes"]})
        for klass_index, klass in enumerate(classes):
            for q in quantiles:
                points = [(s["level"], s["classes"][klass][metric][q]) for s in stages if klass in s["classes"]]
                dash = _DASH.get(q, "solid") if len(runs) == 1 else DASHES[n % len(DASHES)]
                figure.add_scatter(name=_prefixed(run, f"{CLASS_NAMES.get(klass, klass)} {q}", runs),
                                   x=[x for x, _ in points], y=[y for _, y in points], mode="lines+markers",
                                   **_style(colour_of(run.tier, colours), dash=dash,
                                            symbol=SYMBOLS[klass_index % len(SYMBOLS)]))
    title = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
             "e2e": "End-to-end latency"}[metric]
    axis = _axis(runs[0].results) if runs else "load"
    figure.update_layout(title=f"{title} against load", xaxis_title=axis, yaxis={"title": "ms", **MEASURE_AXIS},
                         margin=MARGIN, height=400)
    return figure_html(figure, div_id, empty=NO_LOAD_RESULTS)


def throughput_chart(runs: list[Run], div_id: str = "throughput-chart",
                     colours: Mapping[str, str] | None = None) -> str:
    """Per run: requests and goodput (dashed) per second at each load level."""
    figure = go.Figure()
    for n, run in enumerate(runs):
        stages = run.results.get("stages") or []
        levels = [s["level"] for s in stages]
        colour, symbol = colour_of(run.tier, colours), SYMBOLS[n % len(SYMBOLS)]
        figure.add_scatter(name=_prefixed(run, "requests/s", runs), x=levels,
                           y=[s["throughput"]["requests_per_s"] for s in stages], mode="lines+markers",
                           **_style(colour, symbol=symbol))
        figure.add_scatter(name=_prefixed(run, "goodput/s", runs), x=levels,
                           y=[s["goodput"]["requests_per_s"] for s in stages], mode="lines+markers",
                           **_style(colour, dash="dash", symbol=symbol))
    axis = _axis(runs[0].results) if runs else "load"
    figure.update_layout(title="Throughput and goodput (within the SLOs) against load", xaxis_title=axis,
                         yaxis={"title": "requests per second", **MEASURE_AXIS}, margin=MARGIN, height=360)
    return figure_html(figure, div_id, empty=NO_LOAD_RESULTS)


def task_label(task: str) -> str:
    """A task type with its headline metric: "chart reading (relaxed accuracy)"."""
    known = TASKS.get(task)
    return f"{known.label} ({METRIC_NAMES[known.metric]})" if known else task


def _error_bars(points: list[tuple]) -> dict:
    """95 % intervals as asymmetric error bars, of (x, y, interval, cap) points."""
    return {"type": "data", "symmetric": False,
            "array": [(i[1] - y) if i and y is not None else 0 for _, y, i, _ in points],
            "arrayminus": [(y - i[0]) if i and y is not None else 0 for _, y, i, _ in points]}


def quality_cost_chart(runs: list[Run], *, currency: str, div_id: str = "quality-cost-chart",
                       colours: Mapping[str, str] | None = None) -> str:
    """Per run and task type: its headline metric (with its 95 % interval) against the cost of
    an image in `currency`, one point per pixel cap."""
    figure = go.Figure()
    for n, run in enumerate(runs):
        caps = run.results.get("caps") or []
        for task_index, task in enumerate(sorted({t for cap in caps for t in cap["tasks"]})):
            points = [(float(c["cost_per_image"] or 0), headline(c["tasks"][task]), c["tasks"][task].get("interval"),
                       c["cap"]) for c in caps if task in c["tasks"]]
            figure.add_scatter(name=_prefixed(run, task_label(task), runs), x=[x for x, _, _, _ in points],
                               y=[y for _, y, _, _ in points], text=[f"{cap:,} px" for _, _, _, cap in points],
                               error_y=_error_bars(points), mode="lines+markers",
                               hovertemplate=f"%{{text}}: %{{y:.3f}}, %{{x:,.6f}} {currency} per image",
                               **_style(colour_of(run.tier, colours), dash=DASHES[n % len(DASHES)],
                                        symbol=SYMBOLS[task_index % len(SYMBOLS)]))
    figure.update_layout(title="Quality against cost, one point per pixel cap (bars: 95 % intervals)",
                         xaxis=money_axis(currency, "cost per image"),
                         yaxis={"title": "each task's headline metric", "range": [0, 1.05]}, margin=MARGIN,
                         height=380)
    return figure_html(figure, div_id, empty=NO_SWEEP_RESULTS)


def set_curve_chart(runs: list[Run], *, currency: str, div_id: str = "set-curve-chart",
                    colours: Mapping[str, str] | None = None) -> str:
    """Per run: accuracy on the whole set (with its 95 % interval as error bars) against the
    cost of an image in `currency`, one point per pixel cap; caps without both figures are left
    out."""
    figure = go.Figure()
    for n, run in enumerate(runs):
        points = sorted((float(c["cost_per_image"]), c["overall"]["accuracy"], c["overall"].get("interval"), c["cap"])
                        for c in run.results.get("caps") or []
                        if c.get("cost_per_image") is not None
                        and (c.get("overall") or {}).get("accuracy") is not None)
        figure.add_scatter(name=run.name, x=[x for x, _, _, _ in points], y=[y for _, y, _, _ in points],
                           text=[f"{cap:,} px" for _, _, _, cap in points], error_y=_error_bars(points),
                           mode="lines+markers+text", textposition="top center",
                           hovertemplate=f"%{{text}}: accuracy %{{y:.1%}}, %{{x:,.6f}} {currency} per image",
                           **_style(colour_of(run.tier, colours), dash=DASHES[n % len(DASHES)],
                                    symbol=SYMBOLS[n % len(SYMBOLS)]))
    figure.update_layout(title="Accuracy on the set against cost per image, one point per pixel cap "
                               "(bars: 95 % intervals)",
                         xaxis=money_axis(currency, "cost per image"),
                         yaxis={"title": "accuracy on the set", **ACCURACY_AXIS}, showlegend=True,
                         margin=MARGIN, height=400)
    return figure_html(figure, div_id, empty=NO_SWEEP_RESULTS)


def resolution_chart(results: dict, *, tier: str, div_id: str = "resolution-chart",
                     colours: Mapping[str, str] | None = None) -> str:
    """Image tokens and latency at each pixel cap, in the tier's colour."""
    caps = results.get("caps") or []
    megapixels = [c["cap"] / 1e6 for c in caps]
    colour = colour_of(tier, colours)
    figure = go.Figure()
    for n, (name, values, axis) in enumerate((
            ("image tokens", [c["mean_image_tokens"] for c in caps], "y"),
            ("TTFT p50 (ms)", [c["ttft"]["p50"] for c in caps], "y2"),
            ("E2E p50 (ms)", [c["e2e"]["p50"] for c in caps], "y2"))):
        figure.add_scatter(name=name, x=megapixels, y=values, mode="lines+markers", yaxis=axis,
                           **_style(colour, dash=DASHES[n], symbol=SYMBOLS[n]))
    figure.update_layout(title="Tokens and latency by pixel cap", xaxis_title="pixel cap (megapixels)",
                         yaxis={"title": "image tokens per image", **COUNT_AXIS},
                         yaxis2={"title": "ms", "overlaying": "y", "side": "right", **MEASURE_AXIS},
                         # room on the right for the second axis's ticks, the legend past them
                         margin={**MARGIN, "r": 90}, legend={"x": 1.08}, height=380)
    return figure_html(figure, div_id, empty=NO_SWEEP_RESULTS)


def cascade_chart(points: list, *, cheap_cap: int, strong_cap: int, tier: str, currency: str,
                  div_id: str = "cascade-chart", colours: Mapping[str, str] | None = None) -> str:
    """A cascade's threshold trade-off: accuracy against cost per 1,000 requests in `currency`,
    one point per threshold (cascade_curve.Point), from cheap-only (0) to always escalating (1)."""
    colour = colour_of(tier, colours)
    figure = go.Figure()
    ordered = sorted(points, key=lambda p: p.threshold)
    figure.add_scatter(name="cascade", x=[float(p.cost_per_1000) for p in ordered], y=[p.accuracy for p in ordered],
                       text=["always escalated" if p.always else f"below {p.threshold:.3f}: {p.escalated:.0%} escalated"
                             for p in ordered],
                       mode="lines+markers",
                       hovertemplate=f"%{{text}}<br>accuracy %{{y:.1%}}, %{{x:,.4f}} {currency} per 1,000",
                       **_style(colour))
    ends = [ordered[0], ordered[-1]] if ordered else []
    names = [f"cheap only ({cheap_cap:,} px)", f"both, always ({strong_cap:,} px answers)"]
    for n, (name, end) in enumerate(zip(names, ends, strict=False), start=1):
        figure.add_scatter(name=name, x=[float(end.cost_per_1000)], y=[end.accuracy], mode="markers",
                           marker={"size": 11, "color": colour, "symbol": SYMBOLS[n]})
    figure.update_layout(title="A cascade's threshold: accuracy against cost per 1,000 requests",
                         xaxis=money_axis(currency, "cost per 1,000 requests"),
                         yaxis={"title": "accuracy on the set", **ACCURACY_AXIS}, margin=MARGIN, height=400)
    return figure_html(figure, div_id, empty="No threshold to weigh.")
