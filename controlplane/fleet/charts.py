"""The fleet's charts: one engine's load."""

from __future__ import annotations

import plotly.graph_objects as go

from controlplane.fleet.engine_metrics import Histogram
from controlplane.web.charts import figure_html


def engine_load_chart(samples) -> str:
    """Queue depth, KV usage and TTFT (p50 of each interval) from an engine's recent scrapes."""
    samples = sorted(samples, key=lambda s: s.at)
    times = [s.at.isoformat() for s in samples]
    figure = go.Figure()
    figure.add_scatter(name="running", x=times, y=[s.running for s in samples], mode="lines")
    figure.add_scatter(name="waiting", x=times, y=[s.waiting for s in samples], mode="lines")
    figure.add_scatter(name="KV cache %", x=times, y=[100 * s.kv_cache_usage for s in samples], mode="lines",
                       yaxis="y2")
    ttft, previous = [], None
    for sample in samples:
        current = Histogram.from_json(sample.ttft)
        window = current.since(previous) if current else None
        quantile = window.quantile(0.5) if window else None
        ttft.append(quantile if quantile is not None and quantile != float("inf") else None)
        previous = current
    figure.add_scatter(name="TTFT p50 (s)", x=times, y=ttft, mode="markers", yaxis="y3")
    figure.update_layout(
        title="Engine load", height=340, margin={"l": 50, "r": 90, "t": 50, "b": 40},
        yaxis={"title": "requests"}, yaxis2={"title": "KV %", "overlaying": "y", "side": "right", "range": [0, 100]},
        yaxis3={"overlaying": "y", "side": "right", "position": 0.97, "showgrid": False, "title": "TTFT s"},
        xaxis={"domain": [0, 0.9]},
    )
    return figure_html(figure, "engine-load")
