"""Runs whose worker died, schedules kept in step from the admin, and bad query strings."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.utils import timezone

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from controlplane.benchmarks.services import benchmark_cancel
from controlplane.benchmarks.tasks import benchmark_run
from tests.controlplane.benchmarks.runs import make_profile

pytestmark = pytest.mark.django_db

LONG_AGO = dt.timedelta(hours=2)  # beyond the run task's hard time limit


def _abandoned_run(profile) -> BenchmarkRun:
    """A run whose worker was killed mid-run: the row still says running."""
    return BenchmarkRun.objects.create(profile=profile, state="running", started_at=timezone.now() - LONG_AGO,
                                       task_id="lost")


def test_cancelling_a_run_whose_worker_died_ends_it(world):
    run = _abandoned_run(make_profile(world.vision))
    benchmark_cancel(run=run)
    run.refresh_from_db()
    assert run.state == "cancelled" and run.finished_at is not None


def test_a_run_whose_worker_died_does_not_block_its_schedule_forever(world):
    profile = make_profile(world.vision)
    dead = _abandoned_run(profile)
    benchmark_run.apply(kwargs={"profile_id": profile.pk})  # the schedule's turn (no engine: it fails)
    dead.refresh_from_db()
    assert dead.state == "failed" and "worker" in dead.log
    assert profile.runs.filter(trigger="schedule").count() == 1


def test_a_recent_running_run_still_blocks_its_schedule(world):
    profile = make_profile(world.vision)
    BenchmarkRun.objects.create(profile=profile, state="running", started_at=timezone.now())
    benchmark_run.apply(kwargs={"profile_id": profile.pk})
    assert profile.runs.count() == 1 and profile.runs.get().state == "running"


def _admin_form(world, **fields):
    data = {"name": "nightly", "kind": "load", "tier": world.vision.pk, "target": "instance",
            "gateway_url": "", "text_share": "0.5", "images_per_request_min": "1",
            "images_per_request_max": "1", "image_source": "buckets",
            "image_buckets": '[{"width": 640, "height": 480, "weight": 1}]', "pixel_caps": "[]",
            "prompt_tokens_min": "16", "prompt_tokens_max": "32", "output_tokens_min": "8",
            "output_tokens_max": "16", "arrival": "closed", "sweep": "[2]", "stage_duration_s": "1",
            "seed": "0", "ttft_slo_ms": "5000", "tpot_slo_ms": "1000", "schedule_enabled": "on",
            "schedule_cron": "0 3 * * *", "created_at_0": "2026-01-01", "created_at_1": "00:00:00",
            "images-TOTAL_FORMS": "0", "images-INITIAL_FORMS": "0",
            "eval_items-TOTAL_FORMS": "0", "eval_items-INITIAL_FORMS": "0"}
    return {**data, **fields}


def test_a_profile_scheduled_and_deleted_in_the_admin_has_its_beat_entry_made_and_removed(admin_client, world):
    from django_celery_beat.models import PeriodicTask

    client = admin_client
    response = client.post("/admin/benchmarks/benchmarkprofile/add/", _admin_form(world))
    assert response.status_code == 302, re.findall(r'class="errorlist[^>]*>.*?</ul>', response.content.decode(), re.S)
    profile = BenchmarkProfile.objects.get(name="nightly")
    assert profile.periodic_task is not None and profile.periodic_task.crontab.hour == "3"
    response = client.post(f"/admin/benchmarks/benchmarkprofile/{profile.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not PeriodicTask.objects.filter(task="benchmarks.run").exists()


def test_profiles_deleted_in_bulk_in_the_admin_leave_no_beat_entry(admin_client, world):
    from django_celery_beat.models import PeriodicTask

    from controlplane.benchmarks.services import profile_save

    profiles = [profile_save(profile=make_profile(world.vision, name=name, schedule_enabled=True,
                                                  schedule_cron="*/10 * * * *")) for name in ("a", "b")]
    assert PeriodicTask.objects.filter(task="benchmarks.run").count() == 2
    response = admin_client.post("/admin/benchmarks/benchmarkprofile/", {
        "action": "delete_selected", "_selected_action": [p.pk for p in profiles], "post": "yes"})
    assert response.status_code == 302
    assert not BenchmarkProfile.objects.exists()
    assert not PeriodicTask.objects.filter(task="benchmarks.run").exists()


@pytest.mark.parametrize("query", [{"state": "run\x00ning"}, {"profile": "²"}, {"profile": "9" * 30}])
def test_a_bad_run_filter_is_no_server_error(client, world, query):
    client.force_login(world.operator)
    response = client.get("/api/v1/benchmarks/runs/", query)
    assert response.status_code in (200, 400)


def test_a_run_whose_worker_fell_silent_minutes_ago_is_ended_by_a_cancel(world):
    """Not an hour later: the worker writes a sign of life every half second under load."""
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision), state="running",
                                      started_at=timezone.now() - dt.timedelta(minutes=20),
                                      beat_at=timezone.now() - dt.timedelta(minutes=6))
    benchmark_cancel(run=run)
    run.refresh_from_db()
    assert run.state == "cancelled" and "stopped without finishing" in run.log


def test_a_long_run_whose_worker_is_alive_is_only_asked_to_stop(world):
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision), state="running",
                                      started_at=timezone.now() - dt.timedelta(minutes=50),
                                      beat_at=timezone.now() - dt.timedelta(seconds=1))
    benchmark_cancel(run=run)
    run.refresh_from_db()
    assert (run.state, run.cancel_requested) == ("running", True)  # its worker stops it, keeping results
