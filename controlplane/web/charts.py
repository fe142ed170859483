"""What every chart of the product pages shares: a series' colour, the margins, how a figure
becomes a page's HTML, and how an amount is printed."""

from __future__ import annotations

import zlib
from decimal import Decimal

import plotly.graph_objects as go
import plotly.io as pio

MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
# A tier (or tenant) keeps its colour on every chart: chosen from its name, not from its
# place in a chart's legend, which differs from chart to chart.
# No grey among them: grey is "others".
PALETTE = ("#2f6fde", "#e8710a", "#1b9e77", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#6b8e23",
           "#bcbd22", "#17becf", "#1f3f8f", "#a15c00", "#0b6e4f", "#8c1d18", "#5b3f8c", "#b85c9e")
# Axes of counts and of money start at zero, however flat the data (plotly's default range
# for an all-zero series runs from -1); money is printed as money, never with an SI prefix
# ("150μ"): up to six decimals, thousands apart.
COUNT_AXIS = {"rangemode": "tozero", "tickformat": ",~r"}
MONEY_AXIS = {"rangemode": "tozero", "tickformat": ",.6~f"}


def colour_of(name: str) -> str:
    """The colour of a series named `name` ("others" grey), the same on every chart and page."""
    if name == "others":
        return "#b0b7c3"
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def figure_html(figure: go.Figure, div_id: str) -> str:
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False})


def money(amount) -> str:
    """An amount as every report prints it: to the micro-unit, six places, thousands apart."""
    return f"{Decimal(amount).quantize(Decimal('0.000001')):,f}"
