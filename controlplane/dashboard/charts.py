from __future__ import annotations

import datetime as dt

import plotly.graph_objects as go
import plotly.io as pio


def image_tokens_chart(series: dict[str, list[tuple[dt.date, int]]]) -> str:
    figure = go.Figure()
    for tier, points in series.items():
        figure.add_bar(name=tier, x=[d.isoformat() for d, _ in points], y=[v for _, v in points])
    figure.update_layout(
        barmode="stack", title="Image tokens per day", xaxis_title="day (UTC)",
        yaxis_title="image tokens", margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=380,
        xaxis={"type": "category"},
    )
    return pio.to_html(figure, include_plotlyjs=False, full_html=False,
                       div_id="image-tokens-chart", config={"displaylogo": False})


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
