"""What a rate billed stays billed: every usage event names the rate that priced it, so moving a
tier to another plan, back-dating a rate or writing to rates in bulk never reprices a request
already billed; and a plan bills in one currency, which every report names."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.db.models import ProtectedError
from django.utils import timezone

from controlplane.catalog.models import PricePlan, PriceRate, RateInUse
from controlplane.metering.exports import IMAGE_COLUMNS, per_image_rows
from controlplane.metering.models import ImageCostHistogram, UsageEvent
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Tenant

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]
PICTURE = ImageLine(source_format="jpeg", source_width=1920, source_height=1080, width=1316, height=728,
                    fingerprint="0" * 16)


def _bill(world, request_id, when, tokens=1232):
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
        images=[(PICTURE, tokens, 0)], image_tokens=tokens, text_tokens=20, output_tokens=30, created_at=when))


def _report(world, since, until):
    cost, currency = IMAGE_COLUMNS.index("cost"), IMAGE_COLUMNS.index("currency")
    return [[row[cost], row[currency]]
            for row in per_image_rows(since=since, until=until, tenants=Tenant.objects.filter(pk=world.alice.pk))]


def test_each_event_names_the_rate_that_priced_it(world):
    rate = world.vision.price_plan.rates.get()
    event = _bill(world, "named", timezone.now() - dt.timedelta(hours=1))
    assert event.rate_id == rate.pk
    assert rate.billed_requests() == 1


def test_moving_a_tier_to_another_plan_leaves_what_it_billed_as_it_was_billed(world):
    day = dt.datetime(2025, 6, 10, 10, tzinfo=dt.UTC)
    old_rate = world.vision.price_plan.rates.get()
    _bill(world, "before-the-move", day)
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))
    since, until = day - dt.timedelta(hours=1), day + dt.timedelta(hours=1)
    image = (Decimal(1232) * old_rate.image_per_mtok / 1_000_000 + old_rate.per_image_fee).quantize(Decimal("1e-6"))
    assert _report(world, since, until) == [[image, "USD"]]
    assert list(ImageCostHistogram.objects.values_list("cost", flat=True)) == [image]

    cheaper = PricePlan.objects.create(name="cheaper", currency="USD")
    PriceRate.objects.create(plan=cheaper, effective_from=day - dt.timedelta(days=1), image_per_mtok=Decimal("0.01"))
    world.vision.price_plan = cheaper
    world.vision.full_clean()
    world.vision.save()
    later = _bill(world, "after-the-move", day + dt.timedelta(minutes=30))  # reopens the day's rollup
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))

    cheap = (Decimal(1232) * Decimal("0.01") / 1_000_000).quantize(Decimal("1e-6"))
    assert later.rate.plan == cheaper
    assert _report(world, since, until) == [[image, "USD"], [cheap, "USD"]]
    assert sorted(ImageCostHistogram.objects.values_list("cost", flat=True)) == sorted([image, cheap])
    assert old_rate.billed_requests() == 1  # and so the old plan's rate stays immutable
    old_rate.image_per_mtok = Decimal("9")
    with pytest.raises(RateInUse):
        old_rate.save()


def test_a_rate_back_dated_over_billed_usage_is_refused(world):
    plan = world.vision.price_plan
    _bill(world, "billed-an-hour-ago", timezone.now() - dt.timedelta(hours=1))
    back_dated = PriceRate(plan=plan, effective_from=timezone.now() - dt.timedelta(hours=2),
                           image_per_mtok=Decimal("9"))
    with pytest.raises(ValidationError, match="already billed"):
        back_dated.full_clean()
    with pytest.raises(RateInUse):
        back_dated.save()  # and code that skips clean() too
    future = PriceRate.objects.create(plan=plan, effective_from=timezone.now() + dt.timedelta(days=1),
                                      image_per_mtok=Decimal("9"))
    future.effective_from = timezone.now() - dt.timedelta(hours=2)  # moved into what was billed
    with pytest.raises(RateInUse):
        future.save()
    future.effective_from = timezone.now() + dt.timedelta(days=2)  # moved within the future: fine
    future.save()


def test_bulk_writes_cannot_rewrite_or_remove_a_billed_rate(world):
    rate = world.vision.price_plan.rates.get()
    _bill(world, "billed", timezone.now() - dt.timedelta(minutes=5))
    with pytest.raises(RateInUse):
        PriceRate.objects.filter(pk=rate.pk).update(image_per_mtok=Decimal("9"))
    with pytest.raises((RateInUse, ProtectedError)):
        PriceRate.objects.filter(pk=rate.pk).delete()
    with pytest.raises((RateInUse, ProtectedError)):
        world.vision.price_plan.rates.all().delete()
    # The database itself refuses what went round the models.
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"UPDATE {PriceRate._meta.db_table} SET image_per_mtok = 9 WHERE id = %s", [rate.pk])
    rate.refresh_from_db()
    assert rate.image_per_mtok == Decimal("0.30")
    # A rate nothing billed at is still corrected in bulk, and the change is audited.
    later = PriceRate.objects.create(plan=rate.plan, effective_from=timezone.now() + dt.timedelta(days=3),
                                     image_per_mtok=Decimal("0.5"))
    assert PriceRate.objects.filter(pk=later.pk).update(image_per_mtok=Decimal("0.4")) == 1
    later.refresh_from_db()
    assert later.image_per_mtok == Decimal("0.4")
    from controlplane.audit.services import history
    assert history(later)[0].changes == {"image_per_mtok": ["0.5", "0.4"]}


def test_a_plan_keeps_its_currency_once_it_has_rates_and_names_a_real_one(world):
    plan = world.vision.price_plan
    plan.currency = "EUR"
    with pytest.raises(ValidationError, match="keeps its currency"):
        plan.full_clean()
    with pytest.raises(ValidationError, match="keeps its currency"):
        plan.save()
    with pytest.raises(ValidationError, match="currency"):
        PricePlan(name="made-up", currency="XQZ").full_clean()
    fresh = PricePlan.objects.create(name="fresh", currency="EUR")
    fresh.currency = "GBP"  # no rates yet: still open
    fresh.full_clean()
    fresh.save()


def test_a_tier_that_billed_in_one_currency_is_not_moved_to_another(world):
    _bill(world, "in-dollars", timezone.now() - dt.timedelta(minutes=5))
    euros = PricePlan.objects.create(name="euros", currency="EUR")
    PriceRate.objects.create(plan=euros, effective_from=timezone.now() - dt.timedelta(days=1))
    world.vision.price_plan = euros
    with pytest.raises(ValidationError, match="currency"):
        world.vision.full_clean()
    with pytest.raises(ValidationError, match="currency"):
        world.vision.save()


def test_the_last_rate_of_a_plan_live_tiers_use_is_not_deleted(world):
    plan = PricePlan.objects.create(name="only-one")
    rate = PriceRate.objects.create(plan=plan, effective_from=timezone.now() - dt.timedelta(days=1))
    world.text.price_plan = plan
    world.text.save()
    with pytest.raises(ValidationError, match="text"):
        rate.delete()
    assert UsageEvent.objects.count() == 0
