"""The usage charts read as a report does: axes of counts and money that start at zero however
flat the data, money printed as money, and every tier in a colour of its own, never the grey
of "others"."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

from controlplane.metering.charts import cost_chart, image_tokens_chart
from controlplane.web.charts import colour_of
from tests.charts import figure_of as _figure

DAYS = [dt.date(2026, 12, 1), dt.date(2026, 12, 2)]


def _layout(html: str) -> dict:
    return _figure(html)[1]


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


def _colours(html: str) -> dict[str, str]:
    return {trace["name"]: trace["marker"]["color"] for trace in _figure(html)[0]}


def test_two_tiers_whose_names_would_share_a_colour_get_one_each_on_every_chart(client, world):
    from controlplane.metering.models import DailyUsage
    from controlplane.web.charts import PALETTE
    from tests.factories import VisionTierFactory

    names = {}
    for n in range(1000):  # two names the hash of their names would draw alike
        names.setdefault(colour_of(f"vlm-{n}"), []).append(f"vlm-{n}")
    first, second = next(found for found in names.values() if len(found) > 1)[:2]
    assert colour_of(first) == colour_of(second)
    today = dt.date.today()
    for name in (first, second):
        DailyUsage.objects.create(day=today, tenant=world.alice, tier=VisionTierFactory(name=name), requests=1,
                                  images=1, image_tokens=100, cost="0.5")
    client.force_login(world.operator)
    page = client.get("/usage/").content.decode()
    tokens = _colours(page.split('id="image-tokens-chart"')[1])
    cost = _colours(page.split('id="cost-chart"')[1])
    assert tokens[first] != tokens[second] and {tokens[first], tokens[second]} <= set(PALETTE)
    assert tokens == cost  # each tier in its colour on every chart


def test_charts_over_time_have_a_range_slider_and_buttons_for_a_day_a_week_and_all():
    layout = _layout(image_tokens_chart(DAYS, {"vlm-lite": [1, 2]}))
    assert layout["xaxis"]["rangeslider"]["visible"] and layout["xaxis"]["type"] == "date"
    assert [b["label"] for b in layout["xaxis"]["rangeselector"]["buttons"]] == ["1 day", "7 days", "all"]


def test_the_pages_load_plotlys_basic_bundle_which_draws_every_trace_they_use_at_the_plotly_they_are_made_for():
    """The pages load plotly.js's basic bundle (scatter, bar and pie; a quarter of the whole
    library): every chart the code draws is one of those, for the plotly.js release its
    figures are made for."""
    import ast
    from pathlib import Path

    import plotly

    root = Path(__file__).resolve().parents[3]
    bundle = (root / "static" / "vendor" / "plotly-basic.min.js").read_text()[:200]
    made_for = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text()[:200]
    version = re.search(r"v(\d+\.\d+)\.\d+", bundle).group(1)
    assert "(basic - minified)" in bundle and version == re.search(r"v(\d+\.\d+)\.\d+", made_for).group(1)
    drawn = {node.func.attr for path in (root / "controlplane").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("add_")
             and node.func.attr in {"add_" + kind for kind in ("scatter", "bar", "pie", "heatmap", "histogram", "box",
                                                                 "violin", "scattergl", "contour", "surface")}}
    assert drawn and drawn <= {"add_scatter", "add_bar", "add_pie"}
    assert not any("go." + kind in path.read_text() for path in (root / "controlplane").rglob("*.py")
                   for kind in ("Heatmap(", "Histogram(", "Box(", "Scattergl(", "Violin("))
