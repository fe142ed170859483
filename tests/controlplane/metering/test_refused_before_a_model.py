"""A request refused before its model was known (at its key, or reading its body) is in its
tenant's usage without a tier, at no cost: the rollups count it, every page and total that
reads usage keeps it apart, and nothing bills it."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.metering.exports import monthly_summary_rows
from controlplane.metering.models import DailyUsage, UsageEvent
from controlplane.metering.records import UsageRecord, is_billable, usage_from_json, usage_to_json
from controlplane.metering.rollups import rollup_daily, rollup_hourly
from controlplane.metering.selectors import quota_use
from controlplane.metering.services import usage_record, usage_record_many
from controlplane.metering.statements import statement
from controlplane.metering.traffic import (
    latency_by_class_in_python,
    traffic_by_tier,
    traffic_in_python,
)
from controlplane.tenants.models import Quota, Tenant

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]


def _refused(world, request_id, *, stage="authentication", status=401, code="invalid_api_key",
             message="this API key was revoked", at=None):
    key = world.alice.api_keys.get()
    return UsageRecord(request_id=request_id, tenant_id=world.alice.pk, api_key_id=key.pk, tier_id=None,
                       created_at=at or timezone.now()).failed(stage, status, code=code, message=message)


def _served(world, request_id, *, at=None):
    return UsageRecord(request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
                       text_tokens=100, output_tokens=10, instance_id=None, created_at=at or timezone.now())


def _rolled_up():
    later = timezone.now() + dt.timedelta(seconds=2)  # past the moment every event was recorded
    rollup_hourly(now=later)
    rollup_daily(now=later)


def test_a_refusal_before_a_model_is_kept_at_no_cost_whichever_way_it_is_stored(world):
    record = _refused(world, "one-by-one")
    assert not is_billable(record) and usage_from_json(usage_to_json(record)).tier_id is None
    usage_record(record=record)
    assert usage_record_many(records=[_refused(world, "in-bulk", stage="intake", status=400, code="invalid_json",
                                               message="the request body is not valid JSON"),
                                      _served(world, "served")]) == 2
    for event in UsageEvent.objects.filter(request_id__in=["one-by-one", "in-bulk"]):
        assert event.tier is None and event.cost == 0 and event.rate is None and event.rated
    stored = UsageEvent.objects.get(request_id="in-bulk")
    assert (stored.error_stage, stored.error_code, stored.http_status) == ("intake", "invalid_json", 400)
    assert UsageEvent.objects.get(request_id="served").cost > 0


def test_the_usage_page_statement_and_summary_count_it_unbilled_and_bill_nothing(client, world):
    usage_record(record=_served(world, "served"))
    for n in range(2):
        usage_record(record=_refused(world, f"refused-{n}"))
    _rolled_up()
    (apart,) = DailyUsage.objects.filter(tenant=world.alice, tier=None)
    assert (apart.requests, apart.unbilled_requests, apart.cost) == (2, 2, 0)

    client.force_login(world.operator)
    page = client.get("/usage/", {"tenant": "alice"}).content.decode()
    row = page.split('data-tenant="alice" data-tier=""')[1].split("</tr>")[0]
    assert "<td>2</td><td>2</td>" in row  # requests, of which not billed
    total = page.split('id="usage-table-total"')[1].split("</tr>")[0]
    assert "<th>3</th><th>2</th>" in total and "USD" in total  # one currency still: nothing in none

    now = timezone.now()
    bill = statement(tenant=world.alice, year=now.year, month=now.month)
    assert [line["tier"] for line in bill["lines"]] == ["vlm-lite"] and bill["unbilled_requests"] == 2
    summary = list(monthly_summary_rows(first=now.date().replace(day=1), last=now.date(),
                                        tenants=Tenant.objects.filter(pk=world.alice.pk)))
    assert [row[3] for row in summary] == ["vlm-lite", None]  # its tier's line, and the total
    assert summary[-1][-3] == bill["total"]

    daily = client.get("/api/v1/usage/daily/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()["results"]
    assert sorted((row["tier"] or "", row["unbilled_requests"]) for row in daily) == [("", 2), ("vlm-lite", 0)]
    by_tier = client.get("/api/v1/usage/by-tier/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    assert None in [row["tier"] for row in by_tier["results"]]


def test_the_operations_charts_leave_out_requests_no_tier_served(world):
    now = timezone.now()
    usage_record(record=_served(world, "served", at=now))
    usage_record(record=_refused(world, "refused", at=now))
    since, until = now - dt.timedelta(minutes=1), now + dt.timedelta(minutes=1)
    for traffic in (traffic_by_tier, traffic_in_python):
        assert list(traffic(since=since, until=until, bucket=dt.timedelta(minutes=1))) == [world.vision.pk]
    assert {owner for owner, _ in latency_by_class_in_python(since=since, until=until)} == {world.vision.pk}


def test_the_api_lists_a_refused_request_without_a_model(client, world):
    usage_record(record=_refused(world, "refused"))
    listed = client.get("/api/v1/usage/requests/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    (event,) = listed["results"]
    assert (event["request_id"], event["tier"], Decimal(event["cost"])) == ("refused", None, 0)


def test_refusals_at_a_key_are_not_among_the_requests_a_quota_counts_this_minute(world):
    quota = Quota.objects.create(tenant=world.alice, requests_per_minute=10)
    usage_record(record=_served(world, "served"))
    usage_record(record=_refused(world, "bad-json", stage="intake", status=400, code="invalid_json"))
    for n in range(3):
        usage_record(record=_refused(world, f"revoked-{n}"))
    used = {row["name"]: row["used"] for row in quota_use(tenant=world.alice, quota=quota)}
    assert used["requests_per_minute"] == 2  # as admission and the intake throttle count them
