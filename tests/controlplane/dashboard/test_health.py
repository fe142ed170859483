"""An operator's home page is the service's health at a glance: engines by state per model,
models left without an engine, alerts firing, the last hour's traffic, today's top spenders and
the tenants near a quota. Everyone else's home is their usage."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
import redis
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertRule
from controlplane.fleet.models import EngineInstance, Gpu, Node
from controlplane.gateway.apps import current_process
from controlplane.gateway.refusals import KeylessTally
from controlplane.metering.models import DailyUsage
from controlplane.redis_clients import key_prefix
from controlplane.tenants.models import Quota
from tests.conftest import skip_without_redis
from tests.controlplane.alerts.conftest import usage

pytestmark = pytest.mark.django_db


def _row(page: str, marker: str) -> str:
    return page.split(marker, 1)[1].split("</tr>", 1)[0]


def _section(page: str, section: str) -> str:
    return page.split(f'id="{section}"', 1)[1].split("</section>", 1)[0]


def test_the_operators_home_shows_engines_traffic_and_the_model_left_without_an_engine(client, world):
    now = timezone.now()
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_seen_at=now)
    Gpu.objects.create(node=node, index=0, model="L4", memory_mib=24_576)
    EngineInstance.objects.create(tier=world.vision, node=node, port=8001, actual_state="running", healthy=True,
                                  last_health_at=now)
    EngineInstance.objects.create(tier=world.vision, node=node, port=8002, actual_state="crashloop")
    usage(tenant=world.alice, tier=world.vision, n=18, latency_ms=900, ttft_ms=120, stream=True)
    usage(tenant=world.alice, tier=world.vision, n=2, status="error", http_status=502)
    usage(tenant=world.alice, tier=world.vision, n=3, at=now - dt.timedelta(hours=2))  # outside the hour
    client.force_login(world.operator)
    page = client.get("/").content.decode()

    vision = _row(page, f'data-tier="{world.vision.name}"')
    assert "1 crashloop" in vision and "1 running" in vision and 'data-serving="1"' in vision
    assert re.search(r">20<", vision) and "10.0 %" in vision and "120 / 120 ms" in vision
    text = _row(page, f'data-tier="{world.text.name}"')
    assert 'data-serving="0"' in text and "none" in text
    unserved = page.split('id="unserved"', 1)[1].split("</p>", 1)[0]
    assert world.text.name in unserved and world.vision.name not in unserved and "answered 503" in unserved
    nodes = _section(page, "nodes-health")
    assert "gpu-a" in nodes and "never" not in nodes


def test_the_home_lists_firing_alerts_top_spenders_and_tenants_near_a_quota(client, world):
    rule = AlertRule.objects.get(name="Quota 80 % used")
    Alert.objects.create(rule=rule, subject="tenant:bob", value=91, message="tenant bob has used 91 % of its tokens")
    today = timezone.now().date()
    DailyUsage.objects.create(day=today, tenant=world.alice, tier=world.vision, requests=40, cost="12.5")
    DailyUsage.objects.create(day=today, tenant=world.bob, tier=world.vision, requests=9, cost="30.25")
    DailyUsage.objects.create(day=today - dt.timedelta(days=1), tenant=world.charlie, tier=world.vision,
                              requests=9, cost="99")
    Quota.objects.create(tenant=world.charlie, period="month", total_tokens=1000)
    usage(tenant=world.charlie, tier=world.text, text_tokens=900)
    Quota.objects.create(tenant=world.alice, period="month", total_tokens=10_000)
    usage(tenant=world.alice, tier=world.text, text_tokens=100)
    client.force_login(world.operator)
    page = client.get("/").content.decode()

    assert "tenant bob has used 91 % of its tokens" in _section(page, "alerts-firing")
    spenders = _section(page, "top-spenders")
    assert spenders.index("bob") < spenders.index("alice") and "charlie" not in spenders
    assert "30.25 USD" in spenders and "12.50 USD" in spenders
    near = _section(page, "near-quota")
    assert "charlie" in near and "90 % (900 of 1,000)" in near and "alice" not in near


def test_finance_and_tenant_admins_land_on_their_usage(client, world):
    for user in (world.finance, world.alice_admin):
        client.force_login(user)
        page = client.get("/").content.decode()
        assert 'id="usage-filters"' in page and 'id="tiers-health"' not in page
    client.force_login(world.operator)
    assert 'id="usage-filters"' in client.get("/usage/").content.decode()


def test_the_home_lists_keys_near_their_own_budget_beside_tenants_near_a_quota(client, world):
    from decimal import Decimal

    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record
    from controlplane.tenants.services import api_key_create

    near = api_key_create(tenant=world.bob, name="nightly", spend_limit=Decimal("1.00")).api_key
    far = api_key_create(tenant=world.bob, name="web", spend_limit=Decimal("100")).api_key
    for key in (near, far):  # 0.90 USD each: 90 % of one budget, 0.9 % of the other
        usage_record(record=UsageRecord(request_id=f"spend-{key.name}", tenant_id=world.bob.pk, api_key_id=key.pk,
                                        tier_id=world.vision.pk, output_tokens=1_500_000))
    client.force_login(world.operator)
    section = _section(client.get("/").content.decode(), "near-quota")
    assert "Near a quota or budget" in section and "bob" in section
    row = _row(section, f'href="/keys/{near.pk}/"')
    assert "nightly" in row and "90 % (0.90 USD of 1.00 USD)" in row
    assert f"/keys/{far.pk}/" not in section


@pytest.fixture
def own_tally(settings):
    """The overview's tally of refusals without a key in Redis keys of this test's own."""
    skip_without_redis()
    settings.CACHES = {"default": {**settings.CACHES["default"], "KEY_PREFIX": f"tally-{uuid.uuid4().hex}"}}
    yield
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(f"{key_prefix()}:*"):
        client.delete(key)


def test_the_overview_counts_the_last_hours_requests_refused_without_a_key(client, world, own_tally, settings):
    now = timezone.now().timestamp()
    current_process().keyless = KeylessTally(settings.REDIS_URL, key_prefix(), clock=lambda: now)
    for authorization in (None, None, "Bearer vlm-0000-nope", "Bearer vlm-0000-nope", "Bearer vlm-1111-nope"):
        headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
        assert client.post("/v1/chat/completions", data="{}", content_type="application/json",
                           **headers).status_code == 401
    async_to_sync(current_process().keyless.flush)()  # what its timer does TALLY_FLUSH_S later
    client.force_login(world.operator)
    card = _section(client.get("/").content.decode(), "keyless-refusals")
    assert 'data-reason="missing">2<' in card and 'data-reason="unknown">3<' in card
    assert 'data-busiest="5"' in card


def test_the_overview_says_when_it_cannot_count_requests_refused_without_a_key(client, world, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    client.force_login(world.operator)
    card = _section(client.get("/").content.decode(), "keyless-refusals")
    assert "Not counted here" in card and "vlmcp_gateway_auth_refusals_total" in card
