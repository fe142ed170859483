"""Money is in its plan's currency everywhere it is shown, and amounts in two currencies are
never added together: a tenant using a tier priced in euros and one priced in dollars gets a
total in each, on the statement, the cost API, the monthly summary and the per-image report."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.catalog.models import PricePlan, PriceRate
from controlplane.demo import PRICES_FROM
from controlplane.metering.exports import IMAGE_COLUMNS, monthly_summary_rows, per_image_rows
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import usage_record
from controlplane.metering.statements import statement
from controlplane.tenants.models import Tenant
from tests.factories import VisionTierFactory

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]
PICTURE = ImageLine(source_format="jpeg", source_width=1920, source_height=1080, width=1316, height=728,
                    fingerprint="0" * 16)


@pytest.fixture
def euro_tier(world):
    plan = PricePlan.objects.create(name="euro-vision", currency="EUR")
    PriceRate.objects.create(plan=plan, effective_from=PRICES_FROM, image_per_mtok=Decimal("0.40"),
                             text_input_per_mtok=Decimal("0.10"), per_image_fee=Decimal("0.002"))
    return VisionTierFactory(name="vlm-euro", price_plan=plan)


def _spend(world, euro_tier):
    now = timezone.now()
    events = []
    for n, tier in enumerate([world.vision, euro_tier, euro_tier, world.vision, world.text]):
        images = [(PICTURE, 1224, 0)] if tier.kind == "vision" else []
        events.append(usage_record(record=UsageRecord(
            request_id=f"m{n}", tenant_id=world.alice.pk, api_key_id=None, tier_id=tier.pk, images=images,
            image_tokens=sum(t for _, t, _ in images), text_tokens=100 * (n + 1), output_tokens=10, created_at=now)))
    return now, events


def test_a_statement_totals_each_currency_apart(world, euro_tier):
    now, events = _spend(world, euro_tier)
    bill = statement(tenant=world.alice, year=now.year, month=now.month)
    by_currency = {}
    for event in events:
        currency = event.tier.price_plan.currency
        by_currency[currency] = by_currency.get(currency, Decimal(0)) + event.cost
    assert {t["currency"]: t["total"] for t in bill["totals"]} == by_currency
    assert set(by_currency) == {"USD", "EUR"}
    assert bill["total"] is None and bill["currency"] is None  # nothing adds dollars to euros
    assert {line["tier"]: line["currency"] for line in bill["lines"]} == {
        "vlm-lite": "USD", "vlm-euro": "EUR", "text": "USD"}


def test_the_cost_api_totals_each_currency_apart(client, world, euro_tier):
    _spend(world, euro_tier)
    cost = client.get("/api/v1/cost/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    assert cost["currency"] is None and cost["cost"] is None
    totals = {t["currency"]: Decimal(t["cost"]) for t in cost["totals"]}
    for currency in ("USD", "EUR"):
        assert totals[currency] == sum(Decimal(r["cost"]) for r in cost["by_tier"] if r["currency"] == currency) > 0


def test_the_monthly_summary_and_the_per_image_report_name_each_currency(world, euro_tier):
    now, events = _spend(world, euro_tier)
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))
    tenants = Tenant.objects.filter(pk=world.alice.pk)
    summary = list(monthly_summary_rows(first=now.date().replace(day=1), last=now.date(), tenants=tenants))
    totals = {row[-1]: row[-3] for row in summary if row[2] == "total"}
    assert totals == {currency: sum(e.cost for e in events if e.tier.price_plan.currency == currency)
                      for currency in ("USD", "EUR")}
    report = list(per_image_rows(since=now - dt.timedelta(hours=1), until=now + dt.timedelta(hours=1), tenants=tenants))
    currency = IMAGE_COLUMNS.index("currency")
    assert sorted(row[currency] for row in report) == ["EUR", "EUR", "USD", "USD"]


def test_the_statement_page_shows_a_total_per_currency(client, world, euro_tier):
    now, _ = _spend(world, euro_tier)
    client.force_login(world.finance)
    page = client.get(f"/statements/?tenant=alice&month={now:%Y-%m}").content.decode()
    assert 'data-currency="EUR"' in page and 'data-currency="USD"' in page
    assert "Total in EUR" in page and "Total in USD" in page
