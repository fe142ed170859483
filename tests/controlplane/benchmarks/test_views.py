"""The operator pages: profiles edited with their schedule, runs started, watched, cancelled
and compared; nobody else gets in."""

from __future__ import annotations

import json

import pytest
from django_celery_beat.models import PeriodicTask

from controlplane.benchmarks.models import BenchmarkImage, BenchmarkProfile, BenchmarkRun
from tests.controlplane.benchmarks.runs import finished_run, form_data, make_profile
from tests.images import image_bytes

pytestmark = pytest.mark.django_db


def test_it_creates_a_profile_and_its_beat_schedule_from_the_form(client, world):
    client.force_login(world.operator)
    response = client.post("/benchmarks/new/", form_data(world, schedule_enabled="on", schedule_cron="30 2 * * 1"))
    profile = BenchmarkProfile.objects.get(name="mixed")
    assert response.status_code == 302 and response.url == f"/benchmarks/{profile.pk}/"
    assert profile.sweep == [1, 2.5, 5] and profile.arrival == "open"
    task = PeriodicTask.objects.get(pk=profile.periodic_task_id)
    assert task.task == "benchmarks.run" and json.loads(task.kwargs) == {"profile_id": profile.pk}
    assert task.enabled
    assert (task.crontab.minute, task.crontab.hour, task.crontab.day_of_week) == ("30", "2", "1")


def test_editing_the_schedule_changes_pauses_and_removes_the_beat_entry(client, world):
    client.force_login(world.operator)
    client.post("/benchmarks/new/", form_data(world, schedule_enabled="on", schedule_cron="0 3 * * *"))
    profile = BenchmarkProfile.objects.get(name="mixed")
    client.post(f"/benchmarks/{profile.pk}/", form_data(world, schedule_cron="15 4 * * *"))  # unticked: paused
    task = PeriodicTask.objects.get(pk=profile.periodic_task_id)
    assert not task.enabled and (task.crontab.minute, task.crontab.hour) == ("15", "4")
    client.post(f"/benchmarks/{profile.pk}/", form_data(world, schedule_cron=""))
    profile.refresh_from_db()
    assert profile.periodic_task is None and not PeriodicTask.objects.filter(task="benchmarks.run").exists()


def test_deleting_a_profile_removes_its_schedule(client, world):
    client.force_login(world.operator)
    client.post("/benchmarks/new/", form_data(world, schedule_enabled="on", schedule_cron="0 3 * * *"))
    profile = BenchmarkProfile.objects.get(name="mixed")
    client.post(f"/benchmarks/{profile.pk}/delete/")
    assert not BenchmarkProfile.objects.exists()
    assert not PeriodicTask.objects.filter(task="benchmarks.run").exists()


@pytest.mark.parametrize("field, value, message", [
    ("sweep", "[]", "This field is required"),
    ("sweep", "[1, -2]", "a list of 1 to 20 positive numbers"),
    ("sweep", "[1.5]", "whole numbers"),  # with a closed loop
    ("image_buckets", '[{"width": 0, "height": 10}]', "between 16 and 8192"),
    ("schedule_cron", "every day", "five fields"),
    ("schedule_cron", "99 * * * *", ""),
    ("images_per_request_max", "0", ""),
    ("stage_duration_s", "900", "at most 2400 s"),
    ("pixel_caps", "[100]", "whole pixel counts between 3136"),  # checked for a resolution sweep
])
def test_it_refuses_a_malformed_profile_and_says_why(client, world, field, value, message):
    client.force_login(world.operator)
    data = form_data(world, **{"arrival": "closed", "sweep": "[1, 2, 4]", "kind": "resolution", field: value})
    response = client.post("/benchmarks/new/", data)
    assert response.status_code == 200 and not BenchmarkProfile.objects.exists()
    assert message in response.content.decode()


def test_running_a_profile_queues_a_run_with_its_label_and_the_settings_it_used(client, world, settings):
    client.force_login(world.operator)
    profile = make_profile(world.vision)
    response = client.post(f"/benchmarks/{profile.pk}/run/", {"label": "before"})
    run = BenchmarkRun.objects.get()
    assert response.url == f"/benchmarks/runs/{run.pk}/"
    assert run.label == "before" and run.state == "queued" and run.created_by == world.operator
    assert run.config["tier"]["engine_settings"] == world.vision.engine_settings


def test_images_can_be_uploaded_to_a_profile_and_removed(client, world):
    from django.core.files.uploadedfile import SimpleUploadedFile

    client.force_login(world.operator)
    profile = make_profile(world.vision)
    upload = SimpleUploadedFile("chart.png", image_bytes(800, 600, "PNG"), content_type="image/png")
    client.post(f"/benchmarks/{profile.pk}/images/", {"image": upload})
    image = BenchmarkImage.objects.get()
    assert (image.width, image.height, image.content_type) == (800, 600, "image/png")
    page = client.get(f"/benchmarks/{profile.pk}/").content.decode()
    assert "chart.png (800×600" in page
    bad = SimpleUploadedFile("notes.txt", b"not an image", content_type="text/plain")
    response = client.post(f"/benchmarks/{profile.pk}/images/", {"image": bad}, follow=True)
    assert "not an image" in response.content.decode() and BenchmarkImage.objects.count() == 1
    client.post(f"/benchmarks/{profile.pk}/images/{image.pk}/delete/")
    assert not BenchmarkImage.objects.exists()


def test_a_run_page_shows_progress_results_per_class_and_latency_charts(client, world):
    client.force_login(world.operator)
    run = finished_run(make_profile(world.vision), "before", 240.0)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert 'id="run-state">succeeded' in page and "100%" in page
    text_row = page.split('data-stage="1" data-class="text"')[1].split("</tr>")[0]
    assert "120.0 / 216.0 / 240.0" in text_row
    assert "0.000321 USD per image" in page
    assert 'id="latency-chart"' in page and 'id="throughput-chart"' in page and "Plotly.newPlot" in page
    assert 'http-equiv="refresh"' not in page  # a finished run stops reloading


def test_a_running_run_reloads_and_can_be_cancelled_from_its_page(client, world):
    client.force_login(world.operator)
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision), state="running", progress=0.4)
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert 'http-equiv="refresh"' in page and "40%" in page
    client.post(f"/benchmarks/runs/{run.pk}/cancel/")
    run.refresh_from_db()
    assert run.cancel_requested and run.state == "running"  # the run stops itself at its next poll


def test_two_runs_compare_side_by_side_with_what_changed(client, world):
    client.force_login(world.operator)
    profile = make_profile(world.vision)
    a = finished_run(profile, "before", 400.0, scheduling_policy="fcfs")
    b = finished_run(profile, "after", 100.0, scheduling_policy="priority")
    page = client.get(f"/benchmarks/compare/?a={a.pk}&b={b.pk}").content.decode()
    changes = page.split('id="changes"')[1].split("</table>")[0]
    assert "tier.engine_settings.scheduling_policy" in changes and "fcfs" in changes and "priority" in changes
    row = page.split('data-class="text" data-figure="TTFT p99 (ms)"')[1].split("</tr>")[0]
    assert "400.00" in row and "100.00" in row and "-75.0%" in row
    assert page.count("Plotly.newPlot") == 2


def test_pages_render_for_operators(client, world):
    client.force_login(world.operator)
    profile = make_profile(world.vision)
    run = finished_run(profile, "x", 1.0)
    for url in ("/benchmarks/", "/benchmarks/new/", f"/benchmarks/{profile.pk}/", f"/benchmarks/runs/{run.pk}/",
                "/benchmarks/compare/"):
        assert client.get(url).status_code == 200, url
    assert 'href="/benchmarks/"' in client.get("/").content.decode()  # the nav link


@pytest.mark.parametrize("who", ["finance", "alice_admin", None])
def test_everyone_else_is_refused(client, world, who):
    profile = make_profile(world.vision)
    run = finished_run(profile, "x", 1.0)
    if who:
        client.force_login(getattr(world, who))
    for url in ("/benchmarks/", "/benchmarks/new/", f"/benchmarks/{profile.pk}/", f"/benchmarks/runs/{run.pk}/",
                f"/benchmarks/compare/?a={run.pk}&b={run.pk}"):
        response = client.get(url)
        assert response.status_code == (403 if who else 302), url
    assert client.post(f"/benchmarks/{profile.pk}/run/").status_code in (302, 403)
    assert client.post(f"/benchmarks/runs/{run.pk}/cancel/").status_code in (302, 403)
    assert not BenchmarkRun.objects.exclude(pk=run.pk).exists()
    run.refresh_from_db()
    assert not run.cancel_requested
    if who:
        assert 'href="/benchmarks/"' not in client.get("/").content.decode()


def resolution_run(profile, high_anls=1.0):
    dist = {"p50": 40.0, "p90": 50.0, "p99": 60.0, "mean": 45.0}
    caps = [{"cap": cap, "requests": 4, "errors": 0, "mean_image_tokens": tokens, "mean_output_tokens": 8,
             "ttft": dist, "e2e": dist, "cost_per_image": cost, "cost_per_right_answer": per_right,
             "answers": [[cap, "row-1", "read", "42", 1.0, ""]],
             "tasks": {"read": {"items": 2, "metric": "anls", "value": em, "interval": [em / 2, 1.0],
                                "exact_match": em},
                       "presence": {"items": 2, "metric": "f1", "value": 0.5, "interval": [0.0, 1.0], "exact_match": 0.5,
                                    "pope": {"accuracy": 0.5, "precision": 0.5, "recall": 1.0, "yes_ratio": 1.0,
                                             "unclear": 0}}}}
            for cap, tokens, cost, per_right, em in ((200704, 258, "0.000039", "0.000078", 0.5),
                                                     (1003520, 1282, "0.000192", "0.000256", high_anls))]
    return BenchmarkRun.objects.create(profile=profile, state="succeeded", progress=1.0,
                                       config={"kind": "resolution", "pixel_caps": [200704, 1003520]},
                                       results={"kind": "resolution", "caps": caps})


def test_two_resolution_sweeps_compare_cap_by_cap(client, world):
    client.force_login(world.operator)
    profile = make_profile(world.vision, kind="resolution")
    a, b = resolution_run(profile, 0.75), resolution_run(profile, 1.0)
    page = client.get(f"/benchmarks/compare/?a={a.pk}&b={b.pk}").content.decode()
    row = page.split('data-cap="1003520"')[1].split("</tr>")[0]
    assert "1282 / 1282" in row and "read 0.75 / 1.00 ([0.38, 1.00] / [0.50, 1.00])" in row
    assert "0.000256 USD / 0.000256 USD" in row  # the cost of a right answer
    assert 'id="quality-cost-chart"' in page


def test_a_resolution_run_page_shows_each_cap_and_the_quality_cost_curve(client, world):
    client.force_login(world.operator)
    run = resolution_run(make_profile(world.vision, kind="resolution"))
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    row = page.split('data-cap="1003520"')[1].split("</tr>")[0]
    assert "1282" in row and "0.000192" in row and "0.000256" in row
    assert "read ANLS 1.00 [0.50, 1.00] (2)" in row
    assert "presence F1 0.50 [0.00, 1.00] (2): accuracy 0.50, precision 0.50, recall 1.00, yes-ratio 1.00" in row
    assert 'id="quality-cost-chart"' in page and 'id="resolution-chart"' in page


def test_a_sweep_stored_before_headline_metrics_still_shows_its_anls(client, world):
    client.force_login(world.operator)
    run = resolution_run(make_profile(world.vision, kind="resolution"))
    for cap in run.results["caps"]:
        cap["tasks"] = {"ocr": {"items": 2, "exact_match": 0.5, "anls": 0.75}}
        del cap["cost_per_right_answer"]
    run.save()
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert "ocr ANLS 0.75 (2)" in page.split('data-cap="1003520"')[1].split("</tr>")[0]
    assert 'id="quality-cost-chart"' in page


def test_the_admin_lists_and_opens_profiles_and_runs(admin_client, world):
    client = admin_client
    profile = make_profile(world.vision)
    run = finished_run(profile, "x", 1.0)
    for url in ("/admin/benchmarks/benchmarkprofile/", f"/admin/benchmarks/benchmarkprofile/{profile.pk}/change/",
                "/admin/benchmarks/benchmarkrun/", f"/admin/benchmarks/benchmarkrun/{run.pk}/change/"):
        assert client.get(url).status_code == 200, url


def test_a_gateway_url_inside_the_network_is_a_form_error(client, world, settings):
    client.force_login(world.operator)
    page = client.post("/benchmarks/new/", form_data(world, gateway_url="http://10.0.0.9:8000")).content.decode()
    assert "benchmark target URL host &#x27;10.0.0.9&#x27; resolves to 10.0.0.9, a private address" in page
    assert not BenchmarkProfile.objects.exists()
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["10.0.0.0/8"]
    assert client.post("/benchmarks/new/", form_data(world, gateway_url="http://10.0.0.9:8000")).status_code == 302


def test_a_runs_charts_are_in_its_tiers_colour_and_its_costs_in_its_plans_currency(client, world):
    from controlplane.catalog.charts import tier_colours
    from tests.charts import colour_of_trace, figure_of
    from tests.factories import PricePlanFactory, VisionTierFactory

    tier = VisionTierFactory(name="vlm-euro", price_plan=PricePlanFactory(name="euro", currency="EUR"),
                             resolution_policy=world.vision.resolution_policy)
    client.force_login(world.operator)
    run = resolution_run(make_profile(tier, kind="resolution"))
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    traces, layout = figure_of(page, "quality-cost-chart")
    assert {colour_of_trace(trace) for trace in traces} == {tier_colours()["vlm-euro"]}
    assert tier_colours()["vlm-euro"] != tier_colours()[world.vision.name]
    assert layout["xaxis"]["title"]["text"] == "cost per image (EUR)"
