"""The usage charts read as a report does: axes of counts and money that start at zero however
flat the data, money printed as money, and every tier in a colour of its own, never the grey
of "others"."""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import Decimal

from controlplane.metering.charts import cost_chart, image_tokens_chart
from controlplane.web.charts import colour_of

DAYS = [dt.date(2026, 12, 1), dt.date(2026, 12, 2)]


def _layout(html: str) -> dict:
    """The figure's layout, as plotly writes it into the page."""
    (data, layout) = re.search(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{", html, re.S).groups()
    return json.loads(layout)


def test_a_day_with_nothing_draws_no_axis_below_zero():
    layout = _layout(image_tokens_chart(DAYS, {"vlm-lite": [0, 0]}))
    assert layout["yaxis"]["rangemode"] == "tozero"


def test_money_is_printed_in_decimals_not_with_an_si_prefix():
    layout = _layout(cost_chart(DAYS, {"vlm-lite": [Decimal("0.000150"), Decimal("0.000300")]}, currency="USD"))
    assert layout["yaxis"]["tickformat"] == ",.6~f" and layout["yaxis"]["rangemode"] == "tozero"
    assert layout["yaxis"]["title"]["text"] == "USD"


def test_no_tier_is_drawn_in_a_grey_that_reads_as_others():
    def grey(colour: str) -> bool:
        red, green, blue = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
        return max(red, green, blue) - min(red, green, blue) < 24

    assert grey(colour_of("others"))
    assert not any(grey(colour_of(f"tier-{n}")) for n in range(200))
