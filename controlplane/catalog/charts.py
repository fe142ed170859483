"""The catalog's charts: image tokens against source resolution under each tier's policy; and
each tier's colour on every chart."""

from __future__ import annotations

import plotly.graph_objects as go

from controlplane.catalog.models import ModelTier
from controlplane.web.charts import COUNT_AXIS, MARGIN, colour_of, figure_html, series_colours


def tier_colours(tiers=None) -> dict[str, str]:
    """Each tier's colour, by its place among the tiers in the order they were made: two tiers
    never share one (up to the palette's length), on any chart. `tiers`: every tier, read
    already."""
    if tiers is None:
        return series_colours(ModelTier.objects.order_by("pk").values_list("name", flat=True))
    return series_colours(tier.name for tier in sorted(tiers, key=lambda tier: tier.pk))


def resolution_curves_chart(curves: dict[str, list[tuple[float, int]]], *, div_id: str = "resolution-curves",
                            colours: dict[str, str] | None = None) -> str:
    colours = tier_colours() if colours is None else colours
    figure = go.Figure()
    for tier, points in curves.items():
        figure.add_scatter(name=tier, x=[mp for mp, _ in points], y=[t for _, t in points], mode="lines+markers",
                           line_color=colour_of(tier, colours))
    figure.update_layout(
        title="Image tokens by source resolution (4:3 photo)", xaxis={"title": "source megapixels", "rangemode": "tozero"},
        yaxis={"title": "image tokens", **COUNT_AXIS}, margin=MARGIN, height=340,
    )
    return figure_html(figure, div_id, empty="No vision tier to draw.")
