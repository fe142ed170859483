"""The fleet's charts: one engine's load, and the operations page's lines over time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping

import plotly.graph_objects as go

from controlplane.fleet.engine_metrics import Histogram
from controlplane.web.charts import (
    DASHES,
    MARGIN,
    MEASURE_AXIS,
    SYMBOLS,
    colour_of,
    figure_html,
    time_axis,
)

# What the instance page reads: the last half hour at the default 5 s pass.
ENGINE_LOAD_SPAN = dt.timedelta(minutes=30)


def _ttft_p50(samples) -> list[float | None]:
    """Each scrape's TTFT p50 over the interval since the one before (None where unknown)."""
    found, previous = [], None
    for sample in samples:
        current = Histogram.from_json(sample.ttft)
        window = current.since(previous) if current else None
        quantile = window.quantile(0.5) if window else None
        found.append(quantile if quantile is not None and quantile != float("inf") else None)
        previous = current
    return found


def engine_load_chart(samples, *, tier: str, colours: Mapping[str, str] | None = None) -> str:
    """Queue depth, KV usage and TTFT (p50 of each interval) from an engine's recent scrapes,
    all in its tier's colour, told apart by dash and marker."""
    samples = sorted(samples, key=lambda s: s.at)
    times = [s.at.isoformat() for s in samples]
    colour = colour_of(tier, colours)
    figure = go.Figure()
    for n, (name, values, axis) in enumerate((
            ("running", [s.running for s in samples], "y"),
            ("waiting", [s.waiting for s in samples], "y"),
            ("KV cache %", [100 * s.kv_cache_usage for s in samples], "y2"))):
        figure.add_scatter(name=name, x=times, y=values, mode="lines", yaxis=axis,
                           line={"color": colour, "dash": DASHES[n]})
    figure.add_scatter(name="TTFT p50 (s)", x=times, y=_ttft_p50(samples), mode="markers", yaxis="y3",
                       marker={"color": colour, "symbol": SYMBOLS[1]})
    figure.update_layout(
        title="Engine load", height=380, margin={**MARGIN, "r": 90},
        yaxis={"title": "requests", **MEASURE_AXIS},
        yaxis2={"title": "KV %", "overlaying": "y", "side": "right", "range": [0, 100]},
        yaxis3={"overlaying": "y", "side": "right", "position": 0.97, "showgrid": False, "title": "TTFT s",
                **MEASURE_AXIS},
        xaxis={"domain": [0, 0.9], **time_axis(ENGINE_LOAD_SPAN)},
    )
    return figure_html(figure, "engine-load", empty="No scrapes of this engine yet.")


def operations_chart(div_id: str, title: str, axis: str, series: Mapping[str, list], p50: Callable,
                     p95: Callable | None = None, *, colours: Mapping[str, str], span: dt.timedelta,
                     until: dt.datetime | None = None) -> str:
    """One line per series over the `span` up to `until` (p50 solid, p95 dotted in the same
    colour: its tier's, an engine's series being named "tier#pk on node")."""
    figure = go.Figure()
    for name, points in sorted(series.items()):
        colour = colour_of(name.split("#")[0], colours)
        x = [p.at.isoformat() for p in points]
        figure.add_scatter(name=f"{name} p50" if p95 else name, x=x, y=[p50(p) for p in points], mode="lines+markers",
                           line={"color": colour}, marker={"size": 4}, legendgroup=name)
        if p95:
            figure.add_scatter(name=f"{name} p95", x=x, y=[p95(p) for p in points], mode="lines",
                               line={"color": colour, "dash": "dot"}, legendgroup=name)
    figure.update_layout(title=title, yaxis={"title": axis, **MEASURE_AXIS}, height=340,
                         margin={**MARGIN, "b": 40}, xaxis=time_axis(span, until=until), showlegend=True)
    return figure_html(figure, div_id, empty="Nothing to draw in this window.")
