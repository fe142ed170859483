"""Prices are checked where they are entered, in the model and in the database, and a rate
that has billed anything never changes."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.catalog.models import PricePlan, PriceRate, RateInUse
from controlplane.metering.ratebook import RateBook
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]


@pytest.mark.parametrize("field, value", [("image_per_mtok", "-0.15"), ("per_image_fee", "-1"),
                                          ("cached_image_discount", "1.5"), ("cached_image_discount", "-0.1")])
def test_a_negative_price_or_a_discount_past_100_percent_is_refused(field, value):
    plan = PricePlan.objects.create(name="checked")
    rate = PriceRate(plan=plan, **{field: Decimal(value)})
    with pytest.raises(ValidationError) as refused:
        rate.full_clean()
    assert field in refused.value.message_dict
    with pytest.raises(IntegrityError), transaction.atomic():
        rate.save()  # and the database refuses what skipped the form


def test_a_rate_that_billed_requests_is_immutable_and_a_change_is_a_new_rate(world):
    rate = world.vision.price_plan.rates.get()
    usage_record(record=UsageRecord(request_id="billed", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.vision.pk, image_tokens=1000, text_tokens=10))
    rate.image_per_mtok = Decimal("9")
    with pytest.raises(RateInUse, match="priced 1 requests"):
        rate.save()
    with pytest.raises(RateInUse):
        rate.delete()
    later = PriceRate.objects.create(plan=world.vision.price_plan, effective_from=timezone.now() + dt.timedelta(days=1),
                                     image_per_mtok=Decimal("9"), created_by="olivia")
    later.image_per_mtok = Decimal("8")  # not yet in effect: nothing billed at it
    later.save()
    assert RateBook().rate_at(world.vision.price_plan_id, timezone.now()).pk == rate.pk


def test_an_enabled_tier_needs_a_price_in_effect(world):
    world.vision.price_plan = PricePlan.objects.create(name="empty")
    with pytest.raises(ValidationError, match="needs a price in effect"):
        world.vision.full_clean()


def test_every_change_of_a_price_is_recorded_with_who_when_and_what(world, client):
    from controlplane.audit.models import AuditEntry
    from controlplane.audit.services import history

    plan = world.vision.price_plan
    later = timezone.now() + dt.timedelta(days=7)
    rate = PriceRate.objects.create(plan=plan, effective_from=later, image_per_mtok=Decimal("0.5"), created_by="olivia")
    rate.image_per_mtok = Decimal("0.45")  # corrected before it took effect
    rate.save(actor="pat")
    rate.save(actor="pat")  # saved again unchanged: nothing to record
    entries = list(history(rate))
    assert [(e.actor, e.action) for e in entries] == [("pat", "changed"), ("olivia", "created")]
    assert entries[0].changes == {"image_per_mtok": ["0.5", "0.45"]}
    assert entries[1].changes["image_per_mtok"] == [None, "0.5"]
    rate_id = rate.pk
    rate.delete(actor="pat")
    gone = AuditEntry.objects.filter(object_id=str(rate_id)).first()
    assert (gone.actor, gone.action, gone.changes["image_per_mtok"]) == ("pat", "deleted", ["0.45", None])

