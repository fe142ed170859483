"""What every chart of the product pages shares: a series' colour, the margins, how a figure
becomes a page's HTML, and how an amount is printed."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from decimal import Decimal

import plotly.graph_objects as go
import plotly.io as pio

MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
# A tier keeps its colour on every chart: its place in the catalog's order (`series_colours`),
# never its place in a chart's legend, which differs from chart to chart, so the first
# len(PALETTE) tiers never share one; a tenant's is chosen from its name (there may be
# thousands). No grey among them: grey is "others".
PALETTE = ("#2f6fde", "#e8710a", "#1b9e77", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#6b8e23",
           "#bcbd22", "#17becf", "#1f3f8f", "#a15c00", "#0b6e4f", "#8c1d18", "#5b3f8c", "#b85c9e")
# Axes of counts and of money start at zero, however flat the data (plotly's default range
# for an all-zero series runs from -1); money is printed as money, never with an SI prefix
# ("150μ"): up to six decimals, thousands apart.
COUNT_AXIS = {"rangemode": "tozero", "tickformat": ",~r"}
MONEY_AXIS = {"rangemode": "tozero", "tickformat": ",.6~f"}


def colour_of(name: str, colours: Mapping[str, str] | None = None) -> str:
    """The colour of a series named `name`: its own in `colours` (see series_colours), else
    one chosen from its name ("others" grey), the same on every chart and page."""
    if colours and name in colours:
        return colours[name]
    if name == "others":
        return "#b0b7c3"
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def series_colours(names: Iterable[str]) -> dict[str, str]:
    """Colours for series in a fixed order (tiers, by when they were made): distinct for the
    first len(PALETTE)."""
    return {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(names)}


# Charts over time: a range slider under the axis, and buttons for the last day, week and
# all of it.
TIME_AXIS = {"type": "date", "rangeslider": {"visible": True, "thickness": 0.07},
             "rangeselector": {"buttons": [{"count": 1, "label": "1 day", "step": "day", "stepmode": "backward"},
                                           {"count": 7, "label": "7 days", "step": "day", "stepmode": "backward"},
                                           {"step": "all", "label": "all"}]}}


def figure_html(figure: go.Figure, div_id: str) -> str:
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False})


def money(amount) -> str:
    """An amount as every report prints it: to the micro-unit, six places, thousands apart."""
    return f"{Decimal(amount).quantize(Decimal('0.000001')):,f}"
