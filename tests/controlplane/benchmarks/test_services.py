from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from controlplane.benchmarks.services import benchmark_execute
from controlplane.fleet.models import EngineInstance, Node
from tests.engines import simulator

pytestmark = pytest.mark.django_db


def test_a_run_measures_latency_per_class_against_a_live_engine(world):
    profile = BenchmarkProfile.objects.create(name="smoke", tier=world.vision, requests=12,
                                              concurrency=3, image_share=0.5, image_width=640,
                                              image_height=480, max_tokens=8)
    run = BenchmarkRun.objects.create(profile=profile)
    with simulator(name="vlm-lite") as port:
        node = Node.objects.create(name="local", queue="node.local", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())
        benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded", run.log
    assert run.results["errors"] == 0
    assert run.results["classes"]["text"]["requests"] == 6
    assert run.results["classes"]["image"]["requests"] == 6
    assert 0 < run.results["classes"]["text"]["p50_s"] <= run.results["classes"]["text"]["p99_s"]
    assert run.results["requests_per_s"] > 0


def test_a_run_with_no_engine_fails_with_the_reason(world):
    profile = BenchmarkProfile.objects.create(name="nothing", tier=world.vision)
    run = BenchmarkRun.objects.create(profile=profile)
    benchmark_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "failed"
    assert "no healthy instance" in run.log
