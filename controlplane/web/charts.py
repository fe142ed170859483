"""What every chart of the product pages shares, so that every chart reads alike: a tier's
colour, axes of counts, measures and money that start at zero (money with its currency), a range
slider on charts over time, the margins, what a chart with nothing to draw shows, how a figure
becomes a page's HTML (amounts are written by controlplane.web.money)."""

from __future__ import annotations

import datetime as dt
import zlib
from collections.abc import Iterable, Mapping

import plotly.graph_objects as go
import plotly.io as pio
from django.utils.html import format_html

MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
# A tier keeps its colour on every chart: its place in the catalog's order (`series_colours`),
# never its place in a chart's legend, which differs from chart to chart, so the first
# len(PALETTE) tiers never share one; a tenant's is chosen from its name (there may be
# thousands). No grey among them: grey is "others".
PALETTE = ("#2f6fde", "#e8710a", "#1b9e77", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#6b8e23",
           "#bcbd22", "#17becf", "#1f3f8f", "#a15c00", "#0b6e4f", "#8c1d18", "#5b3f8c", "#b85c9e")
# A sum over tiers (the cached image tokens under the savings): dark, neither a tier's colour
# nor the grey of "others".
TOTAL_COLOUR = "#2b3340"
# Axes of counts and of money start at zero, however flat the data (plotly's default range
# for an all-zero series runs from -1); money is printed as money, never with an SI prefix
# ("150μ"): up to six decimals, thousands apart.
COUNT_AXIS = {"rangemode": "tozero", "tickformat": ",~r"}
MONEY_AXIS = {"rangemode": "tozero", "tickformat": ",.6~f"}
# Latencies, rates and shares: never below zero either, so that a quiet hour is not drawn as
# a cliff.
MEASURE_AXIS = {"rangemode": "tozero"}
# Several series of one tier on one chart share its colour: they are told apart by these.
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "pentagon")


def money_axis(currency: str, title: str = "") -> dict:
    """An axis of amounts in `currency`, which its title names (a tick alone says no more than
    "0.000150")."""
    return {"title": f"{title} ({currency})" if title else currency, **MONEY_AXIS}


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


# The stretches a chart over time offers buttons for: (label, count, step, length).
SPANS = (("15 minutes", 15, "minute", dt.timedelta(minutes=15)), ("1 hour", 1, "hour", dt.timedelta(hours=1)),
         ("6 hours", 6, "hour", dt.timedelta(hours=6)), ("1 day", 1, "day", dt.timedelta(days=1)),
         ("7 days", 7, "day", dt.timedelta(days=7)))


def time_axis(span: dt.timedelta | None = None, *, until: dt.datetime | None = None) -> dict:
    """The x axis of a chart over time: a range slider under it, and buttons for the last day,
    week and all of it; for a chart over a known `span`, buttons for the two longest stretches
    shorter than it instead (a "7 days" button on an hour's chart would do nothing). With
    `until`, the axis shows the whole span up to it, however few points fall in it (one point
    alone would otherwise be drawn across a millisecond)."""
    spans = [s for s in SPANS if s[3] < span][-2:] if span else [s for s in SPANS if s[2] == "day"]
    buttons = [{"count": count, "label": label, "step": step, "stepmode": "backward"}
               for label, count, step, _ in spans]
    axis = {"type": "date", "rangeslider": {"visible": True, "thickness": 0.07},
            "rangeselector": {"buttons": [*buttons, {"step": "all", "label": "all"}]}}
    if span and until:
        shown = [(until - span).isoformat(), until.isoformat()]
        axis["range"], axis["rangeslider"]["range"] = shown, shown
    return axis


TIME_AXIS = time_axis()
NOTHING_TO_DRAW = "Nothing to draw yet."


def has_points(figure: go.Figure) -> bool:
    """Whether any trace of `figure` has a value to draw."""
    return any(value is not None for trace in figure.data for value in (trace.y or ()))


def figure_html(figure: go.Figure, div_id: str, *, empty: str = NOTHING_TO_DRAW) -> str:
    """The figure as a page shows it; a figure with nothing to draw as its title and `empty`,
    which says why, rather than a pair of bare axes running from -1 to 6."""
    if not has_points(figure):
        title = figure.layout.title.text or ""
        return format_html('<div id="{}" class="chart-empty"><h2>{}</h2><p class="muted">{}</p></div>',
                           div_id, title, empty)
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False})
