"""A cascade's threshold from evidence: any two caps of a resolution sweep weighed as its cheap
and strong attempts, what each threshold would give, accuracy against cost, on the run's page."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.benchmarks.cascade_curve import (
    ALWAYS,
    Item,
    cheapest_within,
    curve,
    point,
    run_items,
)
from tests.controlplane.benchmarks.runs import make_profile, sweep
from tests.controlplane.benchmarks.test_curves import _chart_traces, _layout

CHEAP, STRONG = Decimal("0.001"), Decimal("0.004")


def _items() -> list[Item]:
    # Sure and right, sure and right, unsure and wrong (the strong one right), unsure and right.
    return [Item(0.95, 1.0, CHEAP, 1.0, STRONG), Item(0.9, 1.0, CHEAP, 1.0, STRONG),
            Item(0.3, 0.0, CHEAP, 1.0, STRONG), Item(0.5, 1.0, CHEAP, 0.0, STRONG)]


def test_a_threshold_keeps_the_sure_cheap_answers_and_pays_twice_for_the_rest():
    never, low, always = point(_items(), 0.0), point(_items(), 0.4), point(_items(), ALWAYS)
    assert (never.accuracy, never.cost_per_1000, never.escalated) == (0.75, Decimal("1"), 0)
    assert (low.accuracy, low.cost_per_1000, low.escalated) == (1.0, Decimal("2"), 0.25)
    assert (always.accuracy, always.cost_per_1000, always.escalated) == (0.75, Decimal("5"), 1)


def test_the_curve_changes_at_each_items_probability_and_the_cheapest_meeting_a_target_is_found():
    points = curve(_items())
    assert [p.threshold for p in points] == [0.0, 0.3, 0.5, 0.9, 0.95, ALWAYS]
    assert cheapest_within(points, 1.0).threshold == 0.5  # escalates only the item at 0.3
    assert cheapest_within(points, 1.01) is None


def test_always_escalating_escalates_an_answer_sure_to_the_last_digit():
    assert point([Item(1.0, 1.0, CHEAP, 0.0, STRONG)], ALWAYS).escalated == 1.0
    assert point([Item(1.0, 1.0, CHEAP, 0.0, STRONG)], 1.0).escalated == 0.0


def test_an_unknown_probability_or_an_answer_cut_short_is_escalated():
    items = [Item(None, 1.0, CHEAP, 1.0, STRONG), Item(0.99, 0.0, CHEAP, 1.0, STRONG, cut_short=True)]
    assert point(items, 0.0).escalated == 1.0
    assert point(items, 0.0, on_length=False).escalated == 0.5


def _answers(cap: int, rows) -> list[list]:
    return [[cap, f"row-{n}", "read", "42", score, "", confidence, cost] for n, (score, confidence, cost)
            in enumerate(rows)]


@pytest.fixture
def run(world):
    run = sweep(make_profile(world.vision, kind="resolution"))
    low, middle, high = run.results["caps"]
    low["answers"] = _answers(low["cap"], [(1.0, 0.95, "0.001"), (0.0, 0.3, "0.001"), (1.0, 0.5, "0.001")])
    middle["answers"] = _answers(middle["cap"], [(1.0, None, None)] * 3)  # asked before probabilities were kept
    high["answers"] = _answers(high["cap"], [(1.0, 0.99, "0.004")] * 3)
    run.save()
    return run


def test_a_runs_items_pair_up_across_two_caps(run):
    items = run_items(run.results, 200_704, 1_003_520)
    assert [(i.confidence, i.cheap_score, i.strong_score) for i in items] == [(0.95, 1.0, 1.0), (0.3, 0.0, 1.0),
                                                                            (0.5, 1.0, 1.0)]
    assert run_items(run.results, 401_408, 1_003_520) == []  # no probabilities at that cap


@pytest.mark.django_db
def test_the_run_page_weighs_two_caps_as_a_cascade(client, world, run):
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert 'id="cascade"' in page and "3 items asked at both caps" in page
    cascade, cheap_only, always = _chart_traces(page, "cascade-chart")
    assert cheap_only["y"] == [pytest.approx(2 / 3)] and always["y"] == [1.0]
    assert cascade["y"][2] == 1.0  # below 0.5: escalating the item at 0.3 alone gets all three right
    assert "Cheapest within 1 point of always escalating: escalate below <strong>0.500</strong>" in page
    other = client.get(f"/benchmarks/runs/{run.pk}/", {"cheap_cap": 200_704, "strong_cap": 200_704}).content.decode()
    assert "two different caps" in other


@pytest.mark.django_db
def test_a_cascades_costs_name_their_currency(client, world, run):
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert _layout(page, "cascade-chart")["xaxis"]["title"]["text"] == "cost per 1,000 requests (USD)"
    thresholds = page.split('id="cascade-thresholds"')[1].split("</table>")[0]
    assert "<td>1.000000 USD</td>" in thresholds and "per 1,000 requests" in page.split('id="cascade-picks"')[1]


@pytest.mark.django_db
def test_a_run_without_probabilities_has_no_cascade_to_weigh(client, world):
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/runs/{sweep(make_profile(world.vision, kind='resolution')).pk}/")
    assert page.status_code == 200 and 'id="cascade"' not in page.content.decode()
