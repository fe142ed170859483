"""The catalog's charts: image tokens against source resolution under each tier's policy."""

from __future__ import annotations

import plotly.graph_objects as go

from controlplane.web.charts import MARGIN, colour_of, figure_html


def resolution_curves_chart(curves: dict[str, list[tuple[float, int]]], *, div_id: str = "resolution-curves") -> str:
    figure = go.Figure()
    for tier, points in curves.items():
        figure.add_scatter(name=tier, x=[mp for mp, _ in points], y=[t for _, t in points], mode="lines+markers",
                           line_color=colour_of(tier))
    figure.update_layout(
        title="Image tokens by source resolution (4:3 photo)", xaxis_title="source megapixels",
        yaxis_title="image tokens", margin=MARGIN, height=340,
    )
    return figure_html(figure, div_id)
