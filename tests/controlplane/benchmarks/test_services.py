"""Runs end to end: the Celery task against a real engine and through the gateway, cancel,
and the state a run leaves behind."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.db import connections
from django.utils import timezone

from controlplane.benchmarks.models import BenchmarkRun
from controlplane.benchmarks.services import (
    benchmark_cancel,
    benchmark_execute,
    benchmark_start,
    workload_for,
)
from controlplane.benchmarks.tasks import benchmark_run
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance
from controlplane.metering.models import UsageEvent
from controlplane.tenants.models import ApiKey
from tests.controlplane.benchmarks.runs import make_profile


@pytest.mark.django_db
def test_the_task_runs_a_sweep_against_an_instance_and_stores_figures_per_stage_and_class(client, world,
                                                                                         instance):
    profile = make_profile(world.vision, sweep=[2, 3], image_buckets=[
        {"width": 640, "height": 480, "weight": 1}, {"width": 2400, "height": 1800, "weight": 1}])
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_run.apply(args=[run.pk])  # the Celery task, executed here
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    assert run.progress == 1.0 and run.started_at and run.finished_at
    results = run.results
    assert [stage["level"] for stage in results["stages"]] == [2.0, 3.0]
    # How many requests a stage sends, and so which classes it holds, depends on how fast the
    # machine answers: the figures of each class are those of the requests the stage sent.
    # The first stage's two workers send the first two requests at least, an image and a text.
    workload = workload_for(profile)
    assert {workload.spec(0).klass, workload.spec(1).klass} == {"image", "text"}
    assert {"text", "image"} <= set(results["stages"][0]["classes"])
    for n, stage in enumerate(results["stages"]):
        assert stage["errors"] == 0 and stage["requests"] > 0, stage["error_examples"]
        assert stage["throughput"]["requests_per_s"] > 0 and stage["throughput"]["output_tokens_per_s"] > 0
        assert stage["goodput"]["share"] == 1.0  # the SLOs are generous here
        sent = Counter(row[1] for row in results["samples"] if row[0] == n)
        assert {klass: figures["requests"] for klass, figures in stage["classes"].items()} == sent
        assert set(sent) <= {"text", "image", "large_image"}
        if "text" in sent:
            text = stage["classes"]["text"]
            assert 0 < text["ttft"]["p50"] <= text["ttft"]["p90"] <= text["ttft"]["p99"]
            assert text["tpot"]["p50"] > 0 and text["e2e"]["p50"] > text["ttft"]["p50"]
    images = [s for stage in results["stages"] for k, s in stage["classes"].items() if k != "text"]
    assert images and all(s["mean_image_tokens"] > 0 for s in images)
    assert results["stages"][0]["cost"]["per_image"] is not None
    # 640x480 is 391+2 tokens on Qwen2.5-VL; 2400x1800 is capped by the policy at ~1M pixels
    assert sum(stage["requests"] for stage in results["stages"]) == len(results["samples"])
    assert "stage 2 (concurrency 3)" in run.log
    client.force_login(world.operator)  # and the page an operator reads it on
    page = client.get(f"/benchmarks/runs/{run.pk}/").content.decode()
    assert 'data-stage="1" data-class="text"' in page and 'id="latency-chart"' in page


@pytest.mark.django_db
def test_a_run_aimed_at_one_engine_is_metered_nowhere_and_its_log_says_so(world, instance):
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision, sweep=[1]))
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    assert f"against instance {instance.pk} at {instance.base_url} (straight to the engine: not metered)" in run.log
    assert not UsageEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_run_through_the_gateway_uses_a_benchmark_key_meters_it_and_revokes_it(world, instance, gateway_url):
    profile = make_profile(world.vision, target="gateway", gateway_url=gateway_url, sweep=[2])
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    assert run.started_at < run.beat_at <= run.finished_at  # it gave signs of life while it ran
    stage = run.results["stages"][0]
    assert stage["errors"] == 0
    # the gateway reports the exact image tokens of each image request: 393 for 640x480
    assert stage["classes"]["image"]["mean_image_tokens"] == 393
    key = ApiKey.objects.get(name=f"benchmark run {run.pk}")
    assert key.tenant.internal and key.revoked_at is not None
    assert UsageEvent.objects.filter(api_key=key).count() == stage["requests"]


@pytest.mark.django_db(transaction=True)
def test_a_profile_without_a_url_load_tests_the_server_it_is_run_from(world, instance, gateway_url, settings):
    settings.GATEWAY_PUBLIC_URL = gateway_url  # as runlocal sets it: not 127.0.0.1:8000, another process
    profile = make_profile(world.vision, target="gateway", gateway_url="", sweep=[2])
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    assert f"through the gateway at {gateway_url}" in run.log
    assert run.results["stages"][0]["errors"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_run_to_a_gateway_no_longer_trusted_sends_nothing_and_says_why(world, instance, gateway_url, settings):
    profile = make_profile(world.vision, target="gateway", gateway_url=gateway_url, sweep=[2])
    settings.OPERATOR_URL_TRUSTED_NETWORKS = []  # or its name moved inside the network since it was saved
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed"
    assert "benchmark target URL host '127.0.0.1' resolves to 127.0.0.1, a loopback address" in run.log
    assert not ApiKey.objects.filter(name=f"benchmark run {run.pk}").exists()
    assert not UsageEvent.objects.exists()


@pytest.mark.django_db
def test_a_run_on_an_external_engine_at_an_untrusted_address_sends_nothing(world, engine_port):
    tier = ModelTier.objects.create(name="vlm-ext", family="qwen2_5_vl", model_id="m", kind="vision",
                                    engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    external = EngineInstance.objects.create(tier=tier, external_url=f"http://127.0.0.1:{engine_port}",
                                             actual_state="running", healthy=True, last_health_at=timezone.now())
    run = BenchmarkRun.objects.create(profile=make_profile(tier, instance=external))
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed" and "engine URL host '127.0.0.1' resolves to 127.0.0.1, a loopback" in run.log


@pytest.mark.django_db
def test_a_run_with_no_engine_fails_with_the_reason(world):
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision))
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed"
    assert "no healthy instance of vlm-lite" in run.log


@pytest.mark.django_db
def test_a_run_through_the_gateway_fails_with_the_reason_when_its_tenant_is_deactivated(world):
    from controlplane.tenants.services import internal_tenant

    internal = internal_tenant()
    internal.active = False
    internal.save()
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision, target="gateway", gateway_url=""))
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed"
    assert f"{internal.name} is deactivated" in run.log
    assert not ApiKey.objects.filter(tenant=internal).exists()


@pytest.mark.django_db
def test_every_request_failing_fails_the_run_and_says_why(world, instance):
    profile = make_profile(world.vision, text_share=0.0, images_per_request_min=5, images_per_request_max=5)
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed" and "every request failed" in run.log
    assert "At most 4 image(s)" in run.results["stages"][0]["error_examples"][0]


@pytest.mark.django_db
def test_cancelling_a_queued_run_stops_it_before_it_starts(world, instance):
    run = BenchmarkRun.objects.create(profile=make_profile(world.vision))
    benchmark_cancel(run=run)
    assert run.state == "cancelled"
    benchmark_execute(run_id=run.pk)  # the task, had it been picked up anyway
    run.refresh_from_db()
    assert run.state == "cancelled" and run.started_at is None


@pytest.mark.django_db(transaction=True)
def test_cancelling_a_running_run_stops_it_and_keeps_what_it_measured(world, instance):
    profile = make_profile(world.vision, sweep=[2, 2, 2, 2, 2], stage_duration_s=2.0)
    run = BenchmarkRun.objects.create(profile=profile)

    def work():
        try:
            benchmark_execute(run_id=run.pk)
        finally:
            connections.close_all()

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait for the first stage's results to land
        run.refresh_from_db()
        if run.results.get("stages"):
            break
        time.sleep(0.2)
    benchmark_cancel(run=run)
    worker.join(timeout=30)
    run.refresh_from_db()
    assert run.state == "cancelled", run.log
    # Stopped within a stage or two of the cancel (a stage cut short keeps its figures), on a
    # loaded machine too: never the whole sweep.
    assert 1 <= len(run.results["stages"]) < 5
    assert run.results["stages"][0]["requests"] > 0
    assert run.progress < 1.0 and "cancel requested" in run.log


@pytest.mark.django_db
def test_starting_a_run_queues_the_task_after_commit(world, django_capture_on_commit_callbacks, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = True
    from controlplane.celery import app

    app.conf.task_always_eager = True
    try:
        profile = make_profile(world.vision)
        with django_capture_on_commit_callbacks(execute=True):
            run = benchmark_start(profile=profile, label="before", user=world.operator)
        run.refresh_from_db()
    finally:
        app.conf.task_always_eager = False
    # no engine: the eager task ran and failed with its reason
    assert run.state == "failed" and run.label == "before" and run.created_by == world.operator
    assert run.config["tier"]["name"] == "vlm-lite" and run.config["sweep"] == [2]


@pytest.mark.django_db
def test_a_schedules_turn_runs_the_profile_and_beat_knows_the_entry(world, instance):
    from django_celery_beat.schedulers import DatabaseScheduler

    from controlplane.benchmarks.services import profile_save
    from controlplane.celery import app

    profile = make_profile(world.vision, schedule_enabled=True, schedule_cron="*/10 * * * *")
    profile_save(profile=profile)
    entries = DatabaseScheduler(app=app, lazy=True).all_as_schedule()
    entry = entries[profile.periodic_task.name]
    assert entry.task == "benchmarks.run" and entry.kwargs == {"profile_id": profile.pk}
    benchmark_run.apply(kwargs=entry.kwargs)  # what beat sends at the schedule's turn
    run = BenchmarkRun.objects.get(profile=profile)
    assert run.trigger == "schedule" and run.state == "succeeded", run.log
    assert run.label.startswith("scheduled ")


@pytest.mark.django_db
def test_a_schedules_turn_is_skipped_while_the_last_run_is_unfinished(world):
    profile = make_profile(world.vision)
    BenchmarkRun.objects.create(profile=profile, state="running")
    benchmark_run.apply(kwargs={"profile_id": profile.pk})
    assert profile.runs.count() == 1
