"""A month closed by finance: every figure of every report agrees with every other, to the
micro-dollar, over a generated month with a mid-month price change, cache hits (whole and
partial), failures, interruptions, aborted requests and tiled images.

What each figure includes (one meaning each):
- a usage event's cost: what the request is billed; 0 for requests refused or failed before
  an engine worked on them; aborted and interrupted requests are billed for what the engine did;
- a statement and the monthly summary: the sum of the month's event costs, failed requests
  left out of every count;
- the per-image report: one row per image of a billed request, priced on its own (its cached
  share discounted, its fee included), as the event priced it;
- the cost-per-image histogram: the per-image report's images and costs, binned per day.
"""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.catalog.models import PriceRate
from controlplane.fleet.models import EngineInstance
from controlplane.metering.exports import monthly_summary_rows, per_image_rows
from controlplane.metering.models import ImageCostHistogram, UsageEvent
from controlplane.metering.rating import price_parts
from controlplane.metering.services import (
    ImageLine,
    UsageRecord,
    billed,
    rollup_daily,
    usage_record,
    usage_record_many,
)
from controlplane.metering.statements import statement
from controlplane.tenants.models import Tenant

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]

MARCH, APRIL = dt.datetime(2025, 3, 1, tzinfo=dt.UTC), dt.datetime(2025, 4, 1, tzinfo=dt.UTC)
MID_MARCH = dt.datetime(2025, 3, 16, 12, tzinfo=dt.UTC)
PICTURE = ImageLine(source_format="jpeg", source_width=1920, source_height=1080, width=1316, height=728,
                    fingerprint="0" * 16)


def _month(world, seed=3, count=240):
    rng = random.Random(seed)
    PriceRate.objects.create(plan=world.vision.price_plan, effective_from=MID_MARCH, text_input_per_mtok=Decimal("0.25"),
                             image_per_mtok=Decimal("0.45"), output_per_mtok=Decimal("0.90"),
                             per_image_fee=Decimal("0.002"), cached_image_discount=Decimal("0.6"))
    instance = EngineInstance.objects.create(tier=world.vision)
    records = []
    for n in range(count):
        tier = world.vision if rng.random() < 0.75 else world.text
        images = []
        if tier == world.vision:
            for _ in range(rng.choice([1, 1, 1, 2, 3])):  # several: a long image's tiles
                tokens = rng.choice([66, 258, 1224, 1232, 4096])
                images.append((PICTURE, tokens, rng.choice([0, 0, tokens, tokens // 2, max(0, tokens - 72)])))
        status, engine = rng.choice([("ok", instance)] * 8 + [("error", None), ("aborted", None),
                                                               ("aborted", instance), ("interrupted", instance)])
        records.append(UsageRecord(
            request_id=f"r{n}", tenant_id=rng.choice([world.alice, world.bob]).pk, api_key_id=None, tier_id=tier.pk,
            status=status, instance_id=engine.pk if engine else None, images=images,
            image_tokens=sum(t for _, t, _ in images), cached_image_tokens=sum(c for _, _, c in images),
            text_tokens=rng.randint(0, 3000), output_tokens=rng.randint(0, 900),
            created_at=MARCH + dt.timedelta(seconds=rng.randint(0, 31 * 86400 - 1))))
    usage_record_many(records=records[: count // 2])  # both ways in: the batch ingest and one by one
    for record in records[count // 2:]:
        usage_record(record=record)
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))  # events recorded a moment ago too


def _rates_when_made(event):
    """Looked up here on its own, not through the rate book the code under test uses."""
    return PriceRate.objects.filter(plan_id=event.tier.price_plan_id, effective_from__lte=event.created_at) \
        .order_by("-effective_from").first().as_rates()


def _text_and_output_parts(tenant) -> Decimal:
    total = Decimal(0)
    for event in UsageEvent.objects.filter(billed(), tenant=tenant, created_at__gte=MARCH, created_at__lt=APRIL) \
            .select_related("tier__price_plan"):
        rates = _rates_when_made(event)
        parts = price_parts(images=[], text_tokens=event.text_tokens, output_tokens=event.output_tokens, rates=rates)
        total += parts.text + parts.output
    return total


def test_a_closed_month_reconciles_to_the_micro_dollar_across_every_report(world):
    _month(world)
    images_total = Decimal(0)
    for tenant in (world.alice, world.bob):
        bill = statement(tenant=tenant, year=2025, month=3)
        events = UsageEvent.objects.filter(tenant=tenant, created_at__gte=MARCH, created_at__lt=APRIL)
        assert bill["total"] == sum(e.cost for e in events) > 0
        assert bill["total"] == sum((line["cost"] for line in bill["lines"]), Decimal(0))
        per_image = [row[-2] for row in per_image_rows(since=MARCH, until=APRIL,
                                                       tenants=Tenant.objects.filter(pk=tenant.pk))]
        # Every image of a billed request is in the report, priced as its request was.
        assert len(per_image) == sum(e.image_count for e in events.filter(billed()))
        assert sum(per_image, Decimal(0)) + _text_and_output_parts(tenant) == bill["total"]
        summary = {row[2]: row for row in monthly_summary_rows(first=MARCH.date(), last=dt.date(2025, 3, 31),
                                                               tenants=Tenant.objects.filter(pk=tenant.pk))}
        assert summary["total"][-3] == bill["total"]
        images_total += sum(per_image, Decimal(0))
    histogram = ImageCostHistogram.objects.filter(day__gte=MARCH.date(), day__lt=APRIL.date())
    assert sum(row.cost for row in histogram) == images_total


def test_the_cached_share_of_an_image_is_what_its_discount_saved(world):
    _month(world, count=60)
    for event in UsageEvent.objects.filter(billed(), cached_image_tokens__gt=0).select_related("tier__price_plan"):
        rates = _rates_when_made(event)
        lines = [(image.tokens, image.cached_tokens) for image in event.images.order_by("position")]
        assert event.cached_image_tokens == sum(cached for _, cached in lines)
        full = price_parts(images=[(tokens, 0) for tokens, _ in lines], text_tokens=event.text_tokens,
                           output_tokens=event.output_tokens, rates=rates).total
        assert event.cache_savings == full - event.cost > 0
