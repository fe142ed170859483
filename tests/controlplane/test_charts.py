"""Every chart of the product reads alike, whichever page draws it: each tier in its own colour
(the same on every chart), axes of counts, measures and money that start at zero, money with
its currency, a range slider on charts over time, and something said rather than bare axes when
there is nothing to draw. Each chart builder is drawn here with data and without; a builder
added without a case here fails the first test."""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

from controlplane.benchmarks import charts as benchmark_charts
from controlplane.benchmarks.cascade_curve import Point
from controlplane.catalog import charts as catalog_charts
from controlplane.fleet import charts as fleet_charts
from controlplane.metering import charts as metering_charts
from controlplane.metering.usage import CostBucket, CostDistribution
from controlplane.web.charts import MONEY_AXIS, PALETTE, TOTAL_COLOUR
from tests.charts import colour_of_trace, figure_of

# Colours no hash of the names would give, so a chart that ignores them is caught.
COLOURS = {"vlm-lite": PALETTE[3], "vlm-pro": PALETTE[5]}
DAYS = [dt.date(2026, 12, 1), dt.date(2026, 12, 2)]
NOW = dt.datetime(2026, 12, 2, 12, tzinfo=dt.UTC)
MINUTES = [NOW - dt.timedelta(minutes=n) for n in (2, 1, 0)]


@dataclass
class Case:
    draw: object  # () -> html, with data
    draw_empty: object  # () -> html, with nothing to draw
    # The tier each trace is of, by its name (a tier named in it, by default); None: a sum
    # over tiers, drawn in TOTAL_COLOUR.
    tier_of: object = None
    money: dict[str, str] = field(default_factory=dict)  # axis -> the currency its title names


def _named_tier(trace: dict) -> str | None:
    return next((tier for tier in COLOURS if tier in trace.get("name", "")), None)


def _distribution(images: dict[str, int]) -> CostDistribution:
    bucket = CostBucket(Decimal("0.0001"), "0.0001–0.0002", images=images,
                        cost={tier: Decimal("0.00015") * n for tier, n in images.items()})
    return CostDistribution(buckets=[bucket] if images else [], images=sum(images.values()),
                            cost=sum(bucket.cost.values(), Decimal(0)), priced_images=sum(images.values()))


def _sample(at: dt.datetime, waiting: float) -> SimpleNamespace:
    return SimpleNamespace(at=at, running=1.0, waiting=waiting, kv_cache_usage=0.4, ttft=None)


def _traffic(at: dt.datetime, latency: float) -> SimpleNamespace:
    return SimpleNamespace(at=at, latency_p50=latency, latency_p95=2 * latency)


def _load_results(p99: float) -> dict:
    figures = {"ttft": {"p50": p99 / 2, "p99": p99}, "tpot": {"p50": 9.0, "p99": 20.0}}
    return {"arrival": "open", "stages": [
        {"level": level, "classes": {"text": figures, "image": figures},
         "throughput": {"requests_per_s": level}, "goodput": {"requests_per_s": level * 0.9}}
        for level in (1.0, 2.0)]}


def _sweep_results(accuracy: float) -> dict:
    return {"caps": [
        {"cap": cap, "cost_per_image": cost, "mean_image_tokens": cap / 784, "ttft": {"p50": 40.0},
         "e2e": {"p50": 90.0}, "tasks": {"read": {"metric": "anls", "value": accuracy, "interval": [0.6, 0.9]}},
         "overall": {"accuracy": accuracy, "interval": [0.6, 0.9]}}
        for cap, cost in ((200_704, "0.000039"), (1_003_520, "0.000192"))]}


def _runs(results) -> list:
    return [benchmark_charts.Run("vlm-lite #1", results(0.7), "vlm-lite"),
            benchmark_charts.Run("vlm-pro #2", results(0.8), "vlm-pro")]


def _cascade_points() -> list[Point]:
    return [Point(threshold, 0.7 + threshold / 10, None, Decimal("0.04") + Decimal(threshold) / 10, threshold)
            for threshold in (0.0, 0.5, 1.0)]


def _cases() -> dict[str, Case]:
    lite = {"tier_of": lambda trace: "vlm-lite"}
    return {
        "metering.image_tokens_chart": Case(
            lambda: metering_charts.image_tokens_chart(DAYS, {"vlm-lite": [0, 3], "vlm-pro": [1, 2]},
                                                       colours=COLOURS),
            lambda: metering_charts.image_tokens_chart(DAYS, {}, colours=COLOURS)),
        "metering.cost_chart": Case(
            lambda: metering_charts.cost_chart(DAYS, {"vlm-lite": [Decimal("0.00015"), Decimal(0)]},
                                               currency="EUR", colours=COLOURS),
            lambda: metering_charts.cost_chart(DAYS, {}, currency="EUR", colours=COLOURS), money={"yaxis": "EUR"}),
        "metering.cache_savings_chart": Case(
            lambda: metering_charts.cache_savings_chart(DAYS, {"vlm-lite": [Decimal("0.1"), Decimal(0)]},
                                                        {"vlm-lite": [10, 0]}, total=Decimal("0.1"), currency="EUR",
                                                        colours=COLOURS),
            lambda: metering_charts.cache_savings_chart(DAYS, {}, {}, total=None, currency="EUR", colours=COLOURS),
            money={"yaxis": "EUR"}),
        "metering.cost_per_image_chart": Case(
            lambda: metering_charts.cost_per_image_chart(_distribution({"vlm-lite": 3, "vlm-pro": 1}),
                                                         currency="EUR", colours=COLOURS),
            lambda: metering_charts.cost_per_image_chart(_distribution({}), currency="EUR", colours=COLOURS)),
        "catalog.resolution_curves_chart": Case(
            lambda: catalog_charts.resolution_curves_chart({"vlm-lite": [(0.3, 256), (1.2, 1024)]}, colours=COLOURS),
            lambda: catalog_charts.resolution_curves_chart({}, colours=COLOURS)),
        "fleet.engine_load_chart": Case(
            lambda: fleet_charts.engine_load_chart([_sample(at, n) for n, at in enumerate(MINUTES)], tier="vlm-lite",
                                                   colours=COLOURS),
            lambda: fleet_charts.engine_load_chart([], tier="vlm-lite", colours=COLOURS), **lite),
        "fleet.operations_chart": Case(
            lambda: fleet_charts.operations_chart(
                "latency-chart", "Latency (ms)", "ms", {"vlm-lite": [_traffic(at, 100) for at in MINUTES],
                                                        "vlm-pro#3 on gpu-a": [_traffic(at, 90) for at in MINUTES]},
                lambda p: p.latency_p50, lambda p: p.latency_p95, colours=COLOURS, span=dt.timedelta(hours=1)),
            lambda: fleet_charts.operations_chart("latency-chart", "Latency (ms)", "ms", {}, lambda p: p.latency_p50,
                                                  colours=COLOURS, span=dt.timedelta(hours=1))),
        "benchmarks.latency_chart": Case(
            lambda: benchmark_charts.latency_chart(_runs(lambda _: _load_results(300.0)), colours=COLOURS),
            lambda: benchmark_charts.latency_chart([benchmark_charts.Run("vlm-lite #1", {}, "vlm-lite")],
                                                   colours=COLOURS)),
        "benchmarks.throughput_chart": Case(
            lambda: benchmark_charts.throughput_chart(_runs(lambda _: _load_results(300.0)), colours=COLOURS),
            lambda: benchmark_charts.throughput_chart([], colours=COLOURS)),
        "benchmarks.quality_cost_chart": Case(
            lambda: benchmark_charts.quality_cost_chart(_runs(_sweep_results), currency="EUR", colours=COLOURS),
            lambda: benchmark_charts.quality_cost_chart([], currency="EUR", colours=COLOURS), money={"xaxis": "EUR"}),
        "benchmarks.set_curve_chart": Case(
            lambda: benchmark_charts.set_curve_chart(_runs(_sweep_results), currency="EUR", colours=COLOURS),
            lambda: benchmark_charts.set_curve_chart([], currency="EUR", colours=COLOURS), money={"xaxis": "EUR"}),
        "benchmarks.resolution_chart": Case(
            lambda: benchmark_charts.resolution_chart(_sweep_results(0.7), tier="vlm-lite", colours=COLOURS),
            lambda: benchmark_charts.resolution_chart({}, tier="vlm-lite", colours=COLOURS), **lite),
        "benchmarks.cascade_chart": Case(
            lambda: benchmark_charts.cascade_chart(_cascade_points(), cheap_cap=200_704, strong_cap=1_003_520,
                                                   tier="vlm-lite", currency="EUR", colours=COLOURS),
            lambda: benchmark_charts.cascade_chart([], cheap_cap=200_704, strong_cap=1_003_520, tier="vlm-lite",
                                                   currency="EUR", colours=COLOURS),
            money={"xaxis": "EUR"}, **lite),
    }


CASES = _cases()


def _builders() -> set[str]:
    """Every chart builder of the product: the `*_chart` functions of its charts modules."""
    root = Path(__file__).resolve().parents[2] / "controlplane"
    found = set()
    for path in root.glob("*/charts.py"):
        module = importlib.import_module(f"controlplane.{path.parent.name}.charts")
        found |= {f"{path.parent.name}.{name}" for name, function in inspect.getmembers(module, inspect.isfunction)
                  if name.endswith("_chart") and function.__module__ == module.__name__}
    return found


def test_every_chart_builder_is_held_to_the_rules_below():
    assert _builders() == set(CASES)


def _axes(layout: dict) -> dict[str, dict]:
    return {name: axis for name, axis in layout.items() if re.fullmatch(r"[xy]axis\d*", name)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_tier_is_drawn_in_its_own_colour(name):
    case = CASES[name]
    traces, _ = figure_of(case.draw())
    tier_of = case.tier_of or _named_tier
    assert traces
    for trace in traces:
        tier = tier_of(trace)
        assert colour_of_trace(trace) == (COLOURS[tier] if tier else TOTAL_COLOUR), trace.get("name")


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_axes_start_at_zero_however_flat_the_data(name):
    _, layout = figure_of(CASES[name].draw())
    for axis_name, axis in _axes(layout).items():
        if axis_name.startswith("y") or axis_name in CASES[name].money:
            starts_at_zero = axis.get("rangemode") == "tozero" or (axis.get("range") or [None])[0] == 0
            assert starts_at_zero, axis_name


@pytest.mark.parametrize("name", sorted(CASES))
def test_money_is_printed_as_money_and_named_in_its_currency(name):
    _, layout = figure_of(CASES[name].draw())
    axes = _axes(layout)
    for axis_name, currency in CASES[name].money.items():
        assert axes[axis_name]["tickformat"] == MONEY_AXIS["tickformat"], axis_name
        assert currency in axes[axis_name]["title"]["text"], axis_name
    if "xaxis" in CASES[name].money:  # an amount hovered over says its currency too
        for trace in figure_of(CASES[name].draw())[0]:
            hover = trace.get("hovertemplate") or ""
            assert "%{x" not in hover or CASES[name].money["xaxis"] in hover, trace.get("name")


@pytest.mark.parametrize("name", sorted(CASES))
def test_charts_over_time_have_a_range_slider(name):
    _, layout = figure_of(CASES[name].draw())
    for axis_name, axis in _axes(layout).items():
        if axis.get("type") == "date":
            assert axis["rangeslider"]["visible"], axis_name


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_chart_with_nothing_to_draw_says_so_instead_of_drawing_bare_axes(name):
    html = CASES[name].draw_empty()
    assert "Plotly.newPlot" not in html and 'class="chart-empty"' in html
    div_id = re.search(r'Plotly\.newPlot\(\s*"([^"]+)"', CASES[name].draw()).group(1)
    assert f'id="{div_id}"' in html  # where the page links to the chart, the link still lands


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_axis_on_the_right_keeps_its_ticks_clear_of_the_legend(name):
    _, layout = figure_of(CASES[name].draw())
    if any(axis.get("side") == "right" for axis in _axes(layout).values()):
        # the legend past the ticks, or the plot narrowed to leave them room inside it
        clear = (layout.get("legend") or {}).get("x", 1.02) >= 1.08 or layout["xaxis"].get("domain", [0, 1])[1] <= 0.9
        assert clear and layout["margin"]["r"] >= 90
