"""Operators create and edit tenants in product pages: a new tenant starts from the default
quota the operator set, or is unlimited only when someone chooses so; it gets only the tiers
chosen, or every tier when that is chosen; the quota editor shows what the tenant has used."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.metering.periods import period_start
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota, QuotaDefault, Tenant
from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _new(world, **changes):
    data = {"name": "acme", "display_name": "Acme", "active": "on", "isolate_prefix_cache": "on",
            "tier_access": "chosen", "tiers": [world.vision.pk], "quota_mode": "limits", "period": "month",
            "image_tokens": 1_000_000, "total_tokens": 2_000_000}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}



def test_a_new_tenants_form_starts_from_the_default_quota_the_operator_set(client, world):
    client.force_login(world.operator)
    response = client.post("/tenants/", {"period": "day", "image_tokens": 5_000_000, "total_tokens": 9_000_000,
                                         "requests_per_minute": 120})
    assert response.status_code == 302
    page = client.get("/tenants/new/").content.decode()
    assert 'name="image_tokens" value="5000000"' in page and 'name="requests_per_minute" value="120"' in page
    limits = page.split('name="quota_mode" value="limits"')[1].split(">")[0]
    assert "checked" in limits  # the default quota, not "unlimited"
    assert AuditEntry.objects.filter(object_type="quota default", actor=world.operator.username).exists()


def test_a_tenant_is_unlimited_or_on_every_tier_only_when_that_is_chosen(client, world):
    client.force_login(world.operator)
    page = client.post("/tenants/new/", _new(world, tier_access=None, quota_mode=None)).content.decode()
    errors = field_errors(page)
    assert errors.count("This field is required.") == 2  # neither choice is made by leaving it empty
    assert not Tenant.objects.filter(name="acme").exists()
    page = client.post("/tenants/new/", _new(world, tiers=[], image_tokens=None, total_tokens=None)).content.decode()
    assert "choose at least one tier, or let it use every tier" in field_errors(page)
    assert "set at least one limit, or choose unlimited" in field_errors(page)
    client.post("/tenants/new/", _new(world, tier_access="every", quota_mode="unlimited"))
    acme = Tenant.objects.get(name="acme")
    assert not acme.allowed_tiers.exists() and not Quota.objects.filter(tenant=acme).exists()
    row = client.get("/tenants/").content.decode().split('data-tenant="acme"')[1].split("</tr>")[0]
    assert "every tier, present and future" in row and "unlimited" in row


def test_a_new_tenant_gets_only_the_tiers_chosen_and_its_quota_and_the_change_is_recorded(client, world):
    client.force_login(world.operator)
    response = client.post("/tenants/new/", _new(world, default_image_tier=world.vision.pk))
    assert response.status_code == 302 and response["Location"] == "/tenants/acme/"
    acme = Tenant.objects.get(name="acme")
    assert list(acme.allowed_tiers.all()) == [world.vision] and acme.default_image_tier == world.vision
    assert (acme.quota.period, acme.quota.image_tokens, acme.quota.total_tokens) == ("month", 1_000_000, 2_000_000)
    created = AuditEntry.objects.get(object_type="tenant", object_id=str(acme.pk))
    assert created.actor == world.operator.username and created.changes["tiers"] == [None, world.vision.name]
    page = client.post("/tenants/new/", _new(world, name="acme2", default_text_tier=world.text.pk)).content.decode()
    assert f"{world.text.name} is not among the tiers it may use" in field_errors(page)


def test_the_quota_editor_shows_what_the_tenant_used_beside_each_limit(client, world):
    Quota.objects.create(tenant=world.alice, period="month", image_tokens=10_000, total_tokens=40_000)
    usage_record(record=UsageRecord(request_id="req_1", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.vision.pk, image_tokens=2_500, text_tokens=500, output_tokens=1_000))
    client.force_login(world.operator)
    page = client.get(f"/tenants/{world.alice.name}/").content.decode()
    image = page.split('data-limit="image_tokens"')[1].split("</tr>")[0]
    total = page.split('data-limit="total_tokens"')[1].split("</tr>")[0]
    assert "2,500 of 10,000 (25%)" in image and "4,000 of 40,000 (10%)" in total
    row = client.get("/tenants/").content.decode().split(f'data-tenant="{world.alice.name}"')[1].split("</tr>")[0]
    assert "Image tokens: 2,500 of 10,000 (25%)" in row


def test_the_tenant_list_counts_each_tenants_use_over_its_own_period_and_billed_requests_only(client, world):
    Quota.objects.create(tenant=world.alice, period="month", image_tokens=10_000, requests_per_minute=10)
    Quota.objects.create(tenant=world.bob, period="day", total_tokens=10_000)
    now = timezone.now()
    for request_id, tenant, at, status in [
        ("alice-now", world.alice, now, "ok"),
        ("alice-failed", world.alice, now, "error"),  # failed before an engine worked on it: not billed
        ("alice-month", world.alice, period_start("month", now), "ok"),
        ("bob-now", world.bob, now, "ok"),
        ("bob-yesterday", world.bob, period_start("day", now) - dt.timedelta(seconds=1), "ok"),
    ]:
        usage_record(record=UsageRecord(request_id=request_id, tenant_id=tenant.pk, api_key_id=None,
                                        tier_id=world.vision.pk, image_tokens=1_000, text_tokens=500,
                                        output_tokens=500, created_at=at, status=status))
    client.force_login(world.operator)
    page = client.get("/tenants/").content.decode()
    alice, bob = (page.split(f'data-tenant="{name}"')[1].split("</tr>")[0] for name in ("alice", "bob"))
    assert "Image tokens: 2,000 of 10,000 (20%)" in alice
    assert "Requests per minute: 2 of 10 (20%)" in alice  # every request of the last minute
    assert "Total tokens: 2,000 of 10,000 (20%)" in bob


def test_editing_a_tenant_changes_its_quota_and_tiers_and_records_both(client, world):
    Quota.objects.create(tenant=world.alice, period="month", image_tokens=10_000)
    client.force_login(world.operator)
    response = client.post(f"/tenants/{world.alice.name}/", _new(world, name=world.alice.name, image_tokens=20_000,
                                                                 tier_access="every", total_tokens=None))
    assert response.status_code == 302
    world.alice.refresh_from_db()
    assert world.alice.quota.image_tokens == 20_000 and not world.alice.allowed_tiers.exists()
    quota = AuditEntry.objects.get(object_type="quota", action="changed")
    assert quota.changes == {"image_tokens": [10_000, 20_000]}


def test_only_operators_manage_tenants(client, world):
    for user in (world.finance, world.alice_admin):
        client.force_login(user)
        assert client.get("/tenants/").status_code == 403
        assert client.post("/tenants/new/", _new(world)).status_code == 403
    assert QuotaDefault.objects.count() == 0


def test_a_tenants_budget_is_set_on_its_form_and_its_spend_shown_beside_it(client, world):
    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record

    client.force_login(world.operator)
    response = client.post("/tenants/new/", _new(world, spend_limit="2.50", spend_hard="soft"))
    assert response.status_code == 302
    quota = Quota.objects.get(tenant__name="acme")
    assert (quota.spend_limit, quota.spend_hard, quota.spend_currency) == (Decimal("2.50"), False, "USD")
    usage_record(record=UsageRecord(request_id="req-acme", tenant_id=quota.tenant_id, api_key_id=None,
                                    tier_id=world.vision.pk, output_tokens=1_000_000))  # 0.60 USD
    page = client.get("/tenants/acme/").content.decode()
    row = page.split('data-limit="spend_limit"')[1].split("</tr>")[0]
    assert "0.60 USD of 2.50 USD (24%), soft; 1.90 USD left" in row
    refused = client.post("/tenants/acme/", _new(world, spend_limit="-1")).content.decode()
    assert "Ensure this value is greater than or equal to 0.01." in field_errors(refused)
