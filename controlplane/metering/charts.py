"""The usage charts: image tokens, cost and cache savings over time, and the cost of one image."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from decimal import Decimal

import plotly.graph_objects as go

from controlplane.web.charts import (
    COUNT_AXIS,
    MARGIN,
    TIME_AXIS,
    TOTAL_COLOUR,
    colour_of,
    figure_html,
    money_axis,
)
from controlplane.web.money import format_money

NO_USAGE = "No usage in this period."


def _unit(slots: list) -> str:
    return "hour" if slots and isinstance(slots[0], dt.datetime) else "day"


def _slot_labels(slots: list) -> list[str]:
    return [s.strftime("%Y-%m-%d %H:00") if isinstance(s, dt.datetime) else s.isoformat() for s in slots]


def _stacked_bars(slots: list, series: dict[str, list], *, title: str, axis: str, div_id: str,
                  currency: str = "", colours: Mapping[str, str] | None = None) -> str:
    """Bars per slot, one per series stacked; in `currency` when given, else counts."""
    unit = _unit(slots)
    x = _slot_labels(slots)
    figure = go.Figure()
    for name, values in series.items():
        figure.add_bar(name=name, x=x, y=[float(v) for v in values], marker_color=colour_of(name, colours))
    figure.update_layout(
        barmode="stack", title=title, xaxis_title=f"{unit} (UTC)",
        yaxis=money_axis(currency) if currency else {"title": axis, **COUNT_AXIS},
        margin=MARGIN, height=420, xaxis=TIME_AXIS,
    )
    return figure_html(figure, div_id, empty=NO_USAGE)


def image_tokens_chart(slots: list, series: dict[str, list[int]], *, by: str = "tier",
                       colours: Mapping[str, str] | None = None) -> str:
    """Image tokens per hour or day, stacked per tier (each in its colour) or per tenant."""
    split = "" if by == "tier" else f" by {by}"
    return _stacked_bars(slots, series, title=f"Image tokens per {_unit(slots)}{split}", axis="image tokens",
                         div_id=f"image-tokens{split.replace(' ', '-')}-chart", colours=colours)


def cost_chart(slots: list, series: dict[str, list[Decimal]], *, currency: str, by: str = "tier",
               colours: Mapping[str, str] | None = None) -> str:
    """Cost per hour or day, stacked per tier (each in its colour) or per tenant, in `currency`."""
    split = "" if by == "tier" else f" by {by}"
    return _stacked_bars(slots, series, title=f"Cost per {_unit(slots)} ({currency}){split}", axis=currency,
                         div_id=f"cost{split.replace(' ', '-')}-chart", currency=currency, colours=colours)


def cache_savings_chart(slots: list, savings: dict[str, list[Decimal]], cached_tokens: dict[str, list[int]],
                        *, total: Decimal | None, currency: str, colours: Mapping[str, str] | None = None) -> str:
    """What the cached-image discount saved per hour or day and tier, with the cached image
    tokens that earned it (summed over tiers) on a second axis."""
    unit = _unit(slots)
    x = _slot_labels(slots)
    figure = go.Figure()
    for name, values in savings.items():
        figure.add_bar(name=f"{name} saved", x=x, y=[float(v) for v in values],
                       marker_color=colour_of(name, colours))
    if cached_tokens:
        tokens = [sum(values) for values in zip(*cached_tokens.values(), strict=True)]
        figure.add_scatter(name="cached image tokens", x=x, y=tokens, mode="lines+markers", yaxis="y2",
                           line={"color": TOTAL_COLOUR})
    figure.update_layout(
        barmode="stack", title="Saved by cached images" + (f": {format_money(total, currency)} in all" if total is not None
                                                           else f" ({currency})"),
        xaxis_title=f"{unit} (UTC)", yaxis=money_axis(currency, f"saved per {unit}"),
        yaxis2={"title": "cached image tokens", "overlaying": "y", "side": "right", "showgrid": False,
                **COUNT_AXIS},
        margin={**MARGIN, "r": 90}, height=420, xaxis=TIME_AXIS, legend={"x": 1.08},
    )
    return figure_html(figure, "cache-savings-chart", empty=NO_USAGE)


def cost_per_image_chart(distribution, *, currency: str, since: dt.date | None = None,
                         colours: Mapping[str, str] | None = None) -> str:
    """How many images cost how much each, stacked per tier (a `CostDistribution`, of the whole
    days from `since` when given)."""
    x = [bucket.label for bucket in distribution.buckets]
    tiers = sorted({tier for bucket in distribution.buckets for tier in bucket.images})
    figure = go.Figure()
    for tier in tiers:
        figure.add_bar(
            name=tier, x=x, y=[bucket.images.get(tier, 0) for bucket in distribution.buckets],
            marker_color=colour_of(tier, colours),
            customdata=[float(bucket.cost.get(tier, 0)) for bucket in distribution.buckets],
            hovertemplate=f"%{{x}}: %{{y}} images, %{{customdata:,.2f}} {currency} in all",
        )
    single = " " not in currency
    mean = f", {format_money(distribution.mean, currency, each=True)} each on average" \
        if distribution.mean is not None and single else ""
    figure.update_layout(
        barmode="stack", title=f"Cost per image{f' since {since}' if since else ''}: {distribution.images} images{mean}",
        xaxis_title=f"cost of one image ({currency})", yaxis={"title": "images", **COUNT_AXIS}, margin=MARGIN,
        height=380,
        xaxis={"type": "category"},
    )
    return figure_html(figure, "cost-per-image-chart", empty="No images priced in this period.")
