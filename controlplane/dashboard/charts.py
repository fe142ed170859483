from __future__ import annotations

import datetime as dt

import plotly.graph_objects as go
import plotly.io as pio


def _daily_bars(series: dict, *, title: str, axis: str, div_id: str) -> str:
    figure = go.Figure()
    for tier, points in series.items():
        figure.add_bar(name=tier, x=[d.isoformat() for d, _ in points], y=[v for _, v in points])
    figure.update_layout(
        barmode="stack", title=title, xaxis_title="day (UTC)", yaxis_title=axis,
        margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=380, xaxis={"type": "category"},
    )
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False})


def image_tokens_chart(series: dict[str, list[tuple[dt.date, int]]]) -> str:
    return _daily_bars(series, title="Image tokens per day", axis="image tokens", div_id="image-tokens-chart")


def cost_chart(series: dict[str, list[tuple[dt.date, float]]]) -> str:
    return _daily_bars(series, title="Cost per day (USD)", axis="USD", div_id="cost-chart")


def resolution_curves_chart(curves: dict[str, list[tuple[float, int]]]) -> str:
    figure = go.Figure()
    for tier, points in curves.items():
        figure.add_scatter(name=tier, x=[mp for mp, _ in points], y=[t for _, t in points], mode="lines+markers")
    figure.update_layout(
        title="Image tokens by source resolution (4:3 photo)", xaxis_title="source megapixels",
        yaxis_title="image tokens", margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=340,
    )
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id="resolution-curves",
                       config={"displaylogo": False})


def engine_load_chart(samples) -> str:
    """Queue depth, KV usage and TTFT (p50 of each interval) from an engine's recent scrapes."""
    from workers.engines.metrics import Histogram

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
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id="engine-load",
                       config={"displaylogo": False})
