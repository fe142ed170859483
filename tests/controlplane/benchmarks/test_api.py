"""The benchmarks API for operators: profiles CRUD with their schedules, runs started,
read and cancelled; tenants' keys and other staff are refused."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django_celery_beat.models import PeriodicTask
from drf_spectacular.drainage import GENERATOR_STATS

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from tests.controlplane.benchmarks.runs import make_profile

pytestmark = pytest.mark.django_db
PROFILES = "/api/v1/benchmarks/profiles/"
RUNS = "/api/v1/benchmarks/runs/"


def body(world, **overrides):
    return {"name": "api-mixed", "tier": world.vision.pk, "target": "instance", "text_share": 0.8,
            "image_buckets": [{"width": 1280, "height": 720, "weight": 1}], "arrival": "closed",
            "sweep": [1, 2, 4], "stage_duration_s": 5, "ttft_slo_ms": 500, "tpot_slo_ms": 40, **overrides}


def test_operators_create_read_update_and_delete_profiles(client, world):
    client.force_login(world.operator)
    created = client.post(PROFILES, body(world, schedule_enabled=True, schedule_cron="0 */6 * * *"),
                          content_type="application/json")
    assert created.status_code == 201, created.content
    data = created.json()
    assert data["sweep"] == [1, 2, 4] and data["schedule_task"].endswith("api-mixed")
    profile = BenchmarkProfile.objects.get(pk=data["id"])
    assert profile.periodic_task.crontab.hour == "*/6" and profile.periodic_task.enabled
    assert client.get(PROFILES).json()["results"][0]["name"] == "api-mixed"
    changed = client.patch(f"{PROFILES}{profile.pk}/", {"schedule_enabled": False, "sweep": [8]},
                           content_type="application/json")
    assert changed.status_code == 200, changed.content
    profile.refresh_from_db()
    assert profile.sweep == [8] and not profile.periodic_task.enabled
    assert client.delete(f"{PROFILES}{profile.pk}/").status_code == 204
    assert not BenchmarkProfile.objects.exists() and not PeriodicTask.objects.filter(task="benchmarks.run").exists()


@pytest.mark.parametrize("overrides, field", [
    ({"sweep": [1.5]}, "sweep"),
    ({"sweep": []}, "sweep"),
    ({"schedule_cron": "61 * * * *"}, "schedule_cron"),
    ({"image_buckets": [{"width": 10}]}, "image_buckets"),
    ({"text_share": 1.5}, "text_share"),
    ({"output_tokens_min": 100, "output_tokens_max": 10}, "output_tokens_max"),
    ({"kind": "resolution", "pixel_caps": []}, "pixel_caps"),
])
def test_a_malformed_profile_is_refused_field_by_field(client, world, overrides, field):
    client.force_login(world.operator)
    response = client.post(PROFILES, body(world, **overrides), content_type="application/json")
    assert response.status_code == 400 and field in response.json(), response.content
    assert not BenchmarkProfile.objects.exists()


def test_operators_start_list_read_and_cancel_runs(client, world):
    client.force_login(world.operator)
    profile = make_profile(world.vision)
    other = make_profile(world.vision, name="other")
    BenchmarkRun.objects.create(profile=other, state="succeeded")
    started = client.post(f"{PROFILES}{profile.pk}/run/", {"label": "after"}, content_type="application/json")
    assert started.status_code == 201 and started.json()["state"] == "queued"
    run_id = started.json()["id"]
    listed = client.get(RUNS, {"profile": profile.pk}).json()["results"]
    assert [r["id"] for r in listed] == [run_id] and "results" not in listed[0]
    assert len(client.get(RUNS, {"state": "succeeded"}).json()["results"]) == 1
    detail = client.get(f"{RUNS}{run_id}/").json()
    assert detail["label"] == "after" and detail["config"]["sweep"] == [2] and detail["results"] == {}
    cancelled = client.post(f"{RUNS}{run_id}/cancel/")
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelled"


def test_tenant_keys_finance_and_tenant_admins_are_refused(client, world):
    profile = make_profile(world.vision)
    run = BenchmarkRun.objects.create(profile=profile)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {world.alice_key}"}
    assert client.get(PROFILES, **auth).status_code == 403
    assert client.post(f"{RUNS}{run.pk}/cancel/", **auth).status_code == 403
    for user in (world.finance, world.alice_admin):
        client.force_login(user)
        assert client.get(RUNS).status_code == 403
        assert client.post(PROFILES, body(world), content_type="application/json").status_code == 403
    client.logout()
    assert client.get(PROFILES).status_code in (401, 403)
    run.refresh_from_db()
    assert not run.cancel_requested and BenchmarkProfile.objects.count() == 1


def test_the_benchmarks_api_is_in_the_schema_without_warnings(tmp_path):
    GENERATOR_STATS.reset()
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
    schema = (tmp_path / "schema.yaml").read_text()
    for path in ("/api/v1/benchmarks/profiles/{id}/run/:", "/api/v1/benchmarks/runs/{id}/cancel/:"):
        assert path in schema
