"""A resolution run's quality–cost curve: drawn with its intervals beside other sweeps of the
same set, and downloaded as CSV with its answers (text a spreadsheet would run kept as text)."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from tests.controlplane.benchmarks.runs import finished_run, make_profile, sweep
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db


def _rows(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def _chart_traces(page: str, div_id: str) -> list[dict]:
    """The traces a Plotly chart of the page draws."""
    start = re.search(rf'Plotly\.newPlot\(\s*"{div_id}",\s*', page).end()
    return json.JSONDecoder().raw_decode(page, start)[0]


@pytest.fixture
def run(world):
    return sweep(make_profile(world.vision, kind="resolution"), label="nightly")


def test_the_curve_downloads_with_the_set_and_each_task_at_each_cap(client, world, run):
    client.force_login(world.operator)
    response = client.get(f"/benchmarks/runs/{run.pk}/curve.csv")
    assert response["Content-Type"] == "text/csv"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-curve.csv"'
    rows = _rows(response)
    assert list(rows[0]) == ["cap", "task", "metric", "value", "low", "high", "items", "image_tokens",
                             "cost_per_image", "cost_per_right_answer", "ttft_p50_ms", "e2e_p50_ms"]
    assert [(r["cap"], r["task"], r["metric"]) for r in rows] == [
        (str(cap), task, metric) for cap in (200704, 401408, 1003520)
        for task, metric in (("all", "accuracy"), ("read", "anls"))]
    middle = rows[2]
    assert (middle["value"], middle["low"], middle["high"], middle["items"]) == ("0.86", "0.78", "0.91", "100")
    assert (middle["image_tokens"], middle["cost_per_image"], middle["cost_per_right_answer"]) == ("512.0", "0.000080", "")
    assert (middle["ttft_p50_ms"], middle["e2e_p50_ms"]) == ("40.0", "40.0")


def test_answers_download_and_text_a_spreadsheet_would_run_stays_text(client, world, run):
    run.results["caps"][0]["answers"] = [[200704, "row-1", "read", '=HYPERLINK("http://evil","42")', 0.0, "42"],
                                         [200704, "row-2", "read", "-2+3", 1.0, "@sum"]]
    run.save()
    client.force_login(world.operator)
    response = client.get(f"/benchmarks/runs/{run.pk}/answers.csv")
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-answers.csv"'
    rows = _rows(response)
    assert list(rows[0]) == ["cap", "item", "task", "answer", "score", "read_as", "confidence", "cost"]
    assert rows[0]["answer"] == '\'=HYPERLINK("http://evil","42")'
    assert (rows[1]["answer"], rows[1]["read_as"]) == ("'-2+3", "'@sum")
    assert [r["answer"] for r in rows[2:]] == ["42", "42"]  # the other caps' answers as they were


def test_a_load_run_has_no_curve_to_download(client, world):
    client.force_login(world.operator)
    run = finished_run(make_profile(world.vision), "load", 100.0)
    assert client.get(f"/benchmarks/runs/{run.pk}/curve.csv").status_code == 404
    assert client.get(f"/benchmarks/runs/{run.pk}/answers.csv").status_code == 404
    assert client.get("/benchmarks/runs/999999/curve.csv").status_code == 404


@pytest.mark.parametrize("who", ["finance", "alice_admin", None])
def test_only_operators_download_curves(client, world, run, who):
    if who:
        client.force_login(getattr(world, who))
    for url in (f"/benchmarks/runs/{run.pk}/curve.csv", f"/benchmarks/runs/{run.pk}/answers.csv"):
        assert client.get(url).status_code == (403 if who else 302)


def test_the_run_page_draws_accuracy_with_its_intervals_against_cost_beside_other_sweeps(client, world, run):
    pro = VisionTierFactory(name="vlm-pro")
    other = sweep(make_profile(pro, name="pro-sweep", kind="resolution"),
                  curve=((401_408, 0.9, [0.84, 0.95], "0.000300"),))
    elsewhere = sweep(make_profile(pro, name="other-set", kind="resolution"))
    elsewhere.config["eval_set"] = "charts"
    elsewhere.save()
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    choices = page.split('id="curve-runs"')[1].split("</form>")[0]
    assert f"#{other.pk} vlm-pro" in choices and f"#{elsewhere.pk}" not in choices  # only sweeps of the same set
    traces = _chart_traces(page, "set-curve-chart")
    assert [t["name"] for t in traces] == [f"#{run.pk} vlm-lite nightly"]
    mine = traces[0]
    assert mine["x"] == [0.000039, 0.00008, 0.000192] and mine["y"] == [0.7, 0.86, 0.88]
    assert [round(v, 2) for v in mine["error_y"]["array"]] == [0.08, 0.05, 0.05]
    assert [round(v, 2) for v in mine["error_y"]["arrayminus"]] == [0.09, 0.08, 0.08]
    assert mine["text"] == ["200,704 px", "401,408 px", "1,003,520 px"]

    page = client.get(f"/benchmarks/runs/{run.pk}/", {"also": [other.pk]}).content.decode()
    traces = _chart_traces(page, "set-curve-chart")
    assert [t["name"] for t in traces] == [f"#{run.pk} vlm-lite nightly", f"#{other.pk} vlm-pro"]
    assert traces[1]["x"] == [0.0003] and traces[1]["y"] == [0.9]
    refused = client.get(f"/benchmarks/runs/{run.pk}/", {"also": [elsewhere.pk]})
    assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()


def test_the_compare_page_draws_both_sweeps_on_one_curve(client, world, run):
    other = sweep(run.profile, curve=((200_704, 0.5, [0.4, 0.6], "0.000039"),))
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/compare/?a={run.pk}&b={other.pk}").content.decode()
    traces = _chart_traces(page, "set-curve-chart")
    assert [t["name"] for t in traces] == [f"A #{run.pk}", f"B #{other.pk}"]
    assert traces[1]["y"] == [0.5]


def _layout(page: str, div_id: str) -> dict:
    start = re.search(rf'Plotly\.newPlot\(\s*"{div_id}",\s*', page).end()
    decoder = json.JSONDecoder()
    _, end = decoder.raw_decode(page, start)
    return decoder.raw_decode(page, re.compile(r",\s*").match(page, end).end())[0]


def test_every_cost_of_a_sweep_names_its_currency_on_the_page_and_its_charts(client, world, run):
    client.force_login(world.operator)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    for chart in ("set-curve-chart", "quality-cost-chart"):
        assert _layout(page, chart)["xaxis"]["title"]["text"].endswith("(USD)"), chart
    caps = page.split('id="caps"')[1].split("</table>")[0]
    assert "0.000039 USD" in caps and "0.000192 USD" in caps
    page = client.get(f"/benchmarks/compare/?a={run.pk}&b={run.pk}").content.decode()
    assert _layout(page, "set-curve-chart")["xaxis"]["title"]["text"].endswith("(USD)")
    assert "0.000039 USD / 0.000039 USD" in page.split('id="cap-comparison"')[1]


def test_a_load_runs_cost_per_image_names_its_currency(client, world):
    client.force_login(world.operator)
    run = finished_run(make_profile(world.vision), "before", 240.0)
    assert "0.000321 USD per image" in client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
