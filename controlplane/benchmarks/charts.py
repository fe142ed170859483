"""Plotly charts of benchmark results: latency and goodput against load, and quality against cost."""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

from controlplane.benchmarks.scoring import METRIC_NAMES, TASKS, headline
from controlplane.benchmarks.workload import CLASS_NAMES

_DASH = {"p50": "dot", "p90": "dash", "p99": "solid"}


def _axis(results: dict) -> str:
    return "concurrency" if results.get("arrival") == "closed" else "offered load (requests/s)"


def _html(figure: go.Figure, div_id: str) -> str:
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False})


def latency_chart(runs: list[tuple[str, dict]], *, metric: str = "ttft", quantiles=("p50", "p99"),
                  div_id: str = "latency-chart") -> str:
    """One line per run, request class and quantile: `metric` (ms) at each load level."""
    figure = go.Figure()
    for name, results in runs:
        stages = results.get("stages") or []
        classes = sorted({k for stage in stages for k in stage["classes"]})
        for klass in classes:
            for q in quantiles:
                points = [(s["level"], s["classes"][klass][metric][q]) for s in stages if klass in s["classes"]]
                label = f"{CLASS_NAMES.get(klass, klass)} {q}"
                figure.add_scatter(name=f"{name}: {label}" if len(runs) > 1 else label,
                                   x=[x for x, _ in points], y=[y for _, y in points], mode="lines+markers",
                                   line={"dash": _DASH.get(q, "solid")})
    title = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
             "e2e": "End-to-end latency"}[metric]
    axis = _axis(runs[0][1]) if runs else "load"
    figure.update_layout(title=f"{title} against load", xaxis_title=axis, yaxis_title="ms",
                         margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=400)
    return _html(figure, div_id)


def throughput_chart(runs: list[tuple[str, dict]], div_id: str = "throughput-chart") -> str:
    figure = go.Figure()
    for name, results in runs:
        stages = results.get("stages") or []
        levels = [s["level"] for s in stages]
        prefix = f"{name}: " if len(runs) > 1 else ""
        figure.add_scatter(name=f"{prefix}requests/s", x=levels,
                           y=[s["throughput"]["requests_per_s"] for s in stages], mode="lines+markers")
        figure.add_scatter(name=f"{prefix}goodput/s", x=levels, y=[s["goodput"]["requests_per_s"] for s in stages],
                           mode="lines+markers", line={"dash": "dash"})
    axis = _axis(runs[0][1]) if runs else "load"
    figure.update_layout(title="Throughput and goodput (within the SLOs) against load", xaxis_title=axis,
                         yaxis_title="requests per second", margin={"l": 60, "r": 20, "t": 50, "b": 50},
                         height=360)
    return _html(figure, div_id)


def task_label(task: str) -> str:
    """A task type with its headline metric: "chart reading (relaxed accuracy)"."""
    known = TASKS.get(task)
    return f"{known.label} ({METRIC_NAMES[known.metric]})" if known else task


def quality_cost_chart(runs: list[tuple[str, dict]], div_id: str = "quality-cost-chart") -> str:
    """Per run and task type: its headline metric (with its 95 % interval) against the cost of
    an image, one point per pixel cap."""
    figure = go.Figure()
    for name, results in runs:
        caps = results.get("caps") or []
        for task in sorted({t for cap in caps for t in cap["tasks"]}):
            points = [(float(c["cost_per_image"] or 0), headline(c["tasks"][task]), c["tasks"][task].get("interval"),
                       c["cap"]) for c in caps if task in c["tasks"]]
            label = task_label(task)
            errors = {"type": "data", "symmetric": False,
                      "array": [(i[1] - y) if i and y is not None else 0 for _, y, i, _ in points],
                      "arrayminus": [(y - i[0]) if i and y is not None else 0 for _, y, i, _ in points]}
            figure.add_scatter(name=f"{name}: {label}" if len(runs) > 1 else label, x=[x for x, _, _, _ in points],
                               y=[y for _, y, _, _ in points], text=[f"{cap:,} px" for _, _, _, cap in points],
                               error_y=errors, mode="lines+markers")
    figure.update_layout(title="Quality against cost, one point per pixel cap (bars: 95 % intervals)",
                         xaxis_title="cost per image", yaxis_title="each task's headline metric",
                         yaxis={"range": [0, 1.05]}, margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=380)
    return _html(figure, div_id)


def set_curve_chart(runs: list[tuple[str, dict]], div_id: str = "set-curve-chart") -> str:
    """Per run: accuracy on the whole set (with its 95 % interval as error bars) against the
    cost of an image, one point per pixel cap; caps without both figures are left out."""
    figure = go.Figure()
    for name, results in runs:
        points = [(float(c["cost_per_image"]), c["overall"]["accuracy"], c["overall"].get("interval"), c["cap"])
                  for c in results.get("caps") or []
                  if c.get("cost_per_image") is not None and (c.get("overall") or {}).get("accuracy") is not None]
        points.sort()
        errors = {"type": "data", "symmetric": False,
                  "array": [(i[1] - y) if i else 0 for _, y, i, _ in points],
                  "arrayminus": [(y - i[0]) if i else 0 for _, y, i, _ in points]}
        figure.add_scatter(name=name, x=[x for x, _, _, _ in points], y=[y for _, y, _, _ in points],
                           text=[f"{cap:,} px" for _, _, _, cap in points], error_y=errors,
                           mode="lines+markers+text", textposition="top center",
                           hovertemplate="%{text}: accuracy %{y:.1%}, %{x} per image")
    figure.update_layout(title="Accuracy on the set against cost per image, one point per pixel cap "
                               "(bars: 95 % intervals)",
                         xaxis_title="cost per image", yaxis_title="accuracy on the set",
                         yaxis={"range": [0, 1.05], "tickformat": ".0%"}, showlegend=True,
                         margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=400)
    return _html(figure, div_id)


def resolution_chart(results: dict, div_id: str = "resolution-chart") -> str:
    """Image tokens and latency at each pixel cap."""
    caps = results.get("caps") or []
    megapixels = [c["cap"] / 1e6 for c in caps]
    figure = go.Figure()
    figure.add_scatter(name="image tokens", x=megapixels, y=[c["mean_image_tokens"] for c in caps],
                       mode="lines+markers")
    figure.add_scatter(name="TTFT p50 (ms)", x=megapixels, y=[c["ttft"]["p50"] for c in caps], mode="lines+markers",
                       yaxis="y2")
    figure.add_scatter(name="E2E p50 (ms)", x=megapixels, y=[c["e2e"]["p50"] for c in caps], mode="lines+markers",
                       yaxis="y2", line={"dash": "dash"})
    figure.update_layout(title="Tokens and latency by pixel cap", xaxis_title="pixel cap (megapixels)",
                         yaxis_title="image tokens per image",
                         yaxis2={"title": "ms", "overlaying": "y", "side": "right"},
                         margin={"l": 60, "r": 60, "t": 50, "b": 50}, height=380)
    return _html(figure, div_id)


def cascade_chart(points: list, *, cheap_cap: int, strong_cap: int, div_id: str = "cascade-chart") -> str:
    """A cascade's threshold trade-off: accuracy against cost per 1,000 requests, one point per
    threshold (cascade_curve.Point), from cheap-only (0) to always escalating (1)."""
    figure = go.Figure()
    ordered = sorted(points, key=lambda p: p.threshold)
    figure.add_scatter(name="cascade", x=[float(p.cost_per_1000) for p in ordered], y=[p.accuracy for p in ordered],
                       text=["always escalated" if p.always else f"below {p.threshold:.3f}: {p.escalated:.0%} escalated"
                             for p in ordered],
                       mode="lines+markers", hovertemplate="%{text}<br>accuracy %{y:.1%}, %{x:.4f} per 1,000")
    ends = [ordered[0], ordered[-1]] if ordered else []
    names = [f"cheap only ({cheap_cap:,} px)", f"both, always ({strong_cap:,} px answers)"]
    for name, end in zip(names, ends, strict=False):
        figure.add_scatter(name=name, x=[float(end.cost_per_1000)], y=[end.accuracy], mode="markers",
                           marker={"size": 11})
    figure.update_layout(title="A cascade's threshold: accuracy against cost per 1,000 requests",
                         xaxis_title="cost per 1,000 requests", yaxis_title="accuracy on the set",
                         yaxis={"range": [0, 1.05], "tickformat": ".0%"},
                         margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=400)
    return _html(figure, div_id)
