"""Usage events and their pictures partitioned by month (PostgreSQL): a month's rows live in
that month's partition, made ahead, so that a month can go with one DROP."""

import datetime as dt

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.metering.partitions import month_start, next_month, partition_name, partitions_ensure
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record, usage_record_many
from tests.images import image_bytes

pytestmark = [pytest.mark.django_db, pytest.mark.skipif("connection.vendor != 'postgresql'")]


def _record(world, request_id, created_at, pictures=1):
    picture = normalise(image_bytes(320, 240), Policy())
    return UsageRecord(request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
                       images=[(picture, 102)] * pictures, image_tokens=102 * pictures,
                       text_tokens=10, output_tokens=5, status="ok", http_status=200, created_at=created_at)


def _partitions_of(model, **where) -> set[str]:
    """The partitions holding the rows of `model` that match."""
    rows = model.objects.filter(**where).values_list("pk", flat=True)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT DISTINCT tableoid::regclass::text FROM {model._meta.db_table} WHERE id = ANY(%s)",
                       [list(rows)])
        return {name for (name,) in cursor.fetchall()}


def test_a_months_events_and_their_pictures_live_in_that_months_partition(world):
    now = timezone.now()
    event = usage_record(record=_record(world, "req-now", now, pictures=2))
    usage_record_many(records=[_record(world, "req-batch", now)])  # the ingest's way, by COPY
    month = month_start(now)
    assert _partitions_of(UsageEvent, request_id__in=["req-now", "req-batch"]) == {
        partition_name("metering_usageevent", month)}
    assert _partitions_of(UsageImage, event__request_id__in=["req-now", "req-batch"]) == {
        partition_name("metering_usageimage", month)}
    assert event.images.count() == 2


def test_a_month_without_its_partition_waits_in_the_default_and_moves_in_when_it_is_made(world):
    later = month_start(timezone.now()) + dt.timedelta(days=200)  # past what is made ahead
    month = month_start(later)
    usage_record(record=_record(world, "req-later", later))
    assert _partitions_of(UsageEvent, request_id="req-later") == {"metering_usageevent_default"}

    made = partitions_ensure(now=later, ahead=1)
    assert made == [partition_name("metering_usageevent", month), partition_name("metering_usageimage", month),
                    partition_name("metering_usageevent", next_month(month)),
                    partition_name("metering_usageimage", next_month(month))]
    assert _partitions_of(UsageEvent, request_id="req-later") == {partition_name("metering_usageevent", month)}
    assert _partitions_of(UsageImage, event__request_id="req-later") == {partition_name("metering_usageimage", month)}
    assert partitions_ensure(now=later, ahead=1) == []  # made once


def test_the_same_request_recorded_twice_is_stored_once_across_months(world):
    now = timezone.now()
    usage_record(record=_record(world, "req-twice", now))
    usage_record(record=_record(world, "req-twice", now))
    usage_record_many(records=[_record(world, "req-twice", now)])
    assert UsageEvent.objects.filter(request_id="req-twice").count() == 1
    assert UsageImage.objects.filter(event__request_id="req-twice").count() == 1
