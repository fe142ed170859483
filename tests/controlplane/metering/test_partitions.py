"""Usage events and their pictures partitioned by month (PostgreSQL): a month's rows live in
that month's partition, made ahead, so that a month can go with one DROP."""

import csv
import datetime as dt
import gzip
import re
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.exports import per_image_rows
from controlplane.metering.models import DailyUsage, RetiredMonth, UsageEvent, UsageImage
from controlplane.metering.partitions import (
    month_start,
    months_held,
    next_month,
    partition_name,
    partitions_ensure,
    partitions_retire,
)
from controlplane.metering.records import UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.selectors import LogQuery, usage_log
from controlplane.metering.services import usage_record, usage_record_many
from controlplane.metering.statements import statement
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


def _past_month_with_usage(world, months_ago: int = 4) -> dt.datetime:
    """A month `months_ago` back with three requests of alice's (one failed before an engine
    worked on it), in its own partition, rolled up."""
    month = month_start(timezone.now())
    for _ in range(months_ago):
        month = month_start(month - dt.timedelta(days=1))
    partitions_ensure(now=month, ahead=0)
    usage_record_many(records=[_record(world, "req-old-1", month + dt.timedelta(days=3), pictures=2),
                               _record(world, "req-old-2", month + dt.timedelta(days=9))])
    failed = _record(world, "req-old-failed", month + dt.timedelta(days=9))
    failed.status, failed.http_status, failed.image_tokens, failed.images = "error", 503, 0, []
    usage_record(record=failed)
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))  # past what was just recorded
    return month


def test_a_month_past_its_retention_goes_once_checked_and_its_statement_stays_the_same(world, tmp_path):
    month = _past_month_with_usage(world)
    before = statement(tenant=world.alice, year=month.year, month=month.month)
    assert before["lines"] and before["unbilled_requests"] == 1

    assert partitions_retire(keep_months=2, archive_dir=str(tmp_path)) == [f"{month:%Y-%m}"]

    assert month not in months_held()
    assert not UsageEvent.objects.filter(created_at__gte=month, created_at__lt=next_month(month)).exists()
    after = statement(tenant=world.alice, year=month.year, month=month.month)
    assert after["from_rollups"] and not before["from_rollups"]
    assert {k: v for k, v in after.items() if k != "from_rollups"} == {
        k: v for k, v in before.items() if k != "from_rollups"}
    with gzip.open(tmp_path / f"{partition_name('metering_usageevent', month)}.csv.gz", "rt") as copy:
        assert sorted(row["request_id"] for row in csv.DictReader(copy)) == ["req-old-1", "req-old-2", "req-old-failed"]
    with gzip.open(tmp_path / f"{partition_name('metering_usageimage', month)}.csv.gz", "rt") as copy:
        assert len(list(csv.DictReader(copy))) == 3
    retired = RetiredMonth.objects.get()
    assert (retired.events, retired.images) == (3, 3)

    # Usage arriving for it afterwards is not rolled into its statement's record.
    usage_record(record=_record(world, "req-too-late", month + dt.timedelta(days=12)))
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=4))
    assert statement(tenant=world.alice, year=month.year, month=month.month) == after


def test_a_month_whose_rollups_differ_from_its_events_is_kept(world):
    month = _past_month_with_usage(world)
    DailyUsage.objects.filter(day__gte=month.date()).update(cost=F("cost") + Decimal("0.000001"))

    assert partitions_retire(keep_months=2) == []

    assert month in months_held()
    assert not RetiredMonth.objects.exists()


def test_a_month_within_its_retention_is_kept(world):
    month = _past_month_with_usage(world, months_ago=2)
    assert partitions_retire(keep_months=2) == []
    assert month in months_held()


def _months_back(months: int) -> dt.datetime:
    month = month_start(timezone.now())
    for _ in range(months):
        month = month_start(month - dt.timedelta(days=1))
    return month


def _log(query, limit) -> list[str]:
    """Every request of the log, page after page of `limit`."""
    seen, after = [], None
    while True:
        page, after = usage_log(query, after=after, limit=limit)
        seen += [event.request_id for event in page]
        if after is None:
            return seen


def test_the_request_log_pages_through_every_month_and_the_history_before_them(world):
    # Requests this month, in two earlier months with partitions (one between them empty),
    # before the oldest partition (kept in the default one), and in a month made ahead.
    partitions_ensure(now=_months_back(4), ahead=0)
    partitions_ensure(now=_months_back(2), ahead=0)
    moments = [timezone.now() - dt.timedelta(minutes=1), _months_back(2) + dt.timedelta(days=1),
               _months_back(2), _months_back(4) + dt.timedelta(days=20), _months_back(4) - dt.timedelta(days=3),
               _months_back(9), month_start(timezone.now()) + dt.timedelta(days=40)]
    for n, moment in enumerate(moments):
        for k in range(3):
            usage_record(record=_record(world, f"req-{n}-{k}", moment + dt.timedelta(seconds=k)))
    assert _partitions_of(UsageEvent, request_id="req-5-0") == {"metering_usageevent_default"}
    newest_first = [f"req-{n}-{k}" for n, _ in sorted(enumerate(moments), key=lambda m: m[1], reverse=True)
                    for k in (2, 1, 0)]

    for limit in (1, 2, 4, 50):
        assert _log(LogQuery(), limit) == newest_first
    # Bounded by a period: only what was made in it, across the months it spans.
    since, until = _months_back(4), _months_back(2) + dt.timedelta(days=1)
    assert _log(LogQuery(since=since, until=until), 2) == [
        request for request in newest_first if since <= moments[int(request.split("-")[1])] < until]
    assert _log(LogQuery(request_id="req-5-1"), 2) == ["req-5-1"]


def _picture_partitions_read(run) -> set[str]:
    """The partitions of the pictures that the queries `run` makes would scan (by their plans)."""
    with CaptureQueriesContext(connection) as captured:
        run()
    read = set()
    for query in captured.captured_queries:
        sql = query["sql"]
        if "metering_usageimage" not in sql or not re.match(r"\s*(SELECT|DECLARE)", sql, re.I):
            continue
        with connection.cursor() as cursor:  # a streamed read is a cursor declared for its SELECT
            cursor.execute("EXPLAIN " + sql[sql.upper().index("SELECT"):])
            read |= {name for (line,) in cursor.fetchall()
                     for name in re.findall(r"\b(metering_usageimage_(?:p[0-9]{6}|default))\b(?!_)", line)}
    return read


def test_a_days_rollup_and_a_periods_export_read_the_pictures_of_their_months_only(world):
    now = timezone.now()
    usage_record_many(records=[_record(world, "req-today", now, pictures=2)])
    this_month = {partition_name("metering_usageimage", month_start(now))}

    assert _picture_partitions_read(lambda: rollup_daily(now=now + dt.timedelta(seconds=2))) == this_month
    rows = []
    assert _picture_partitions_read(lambda: rows.extend(per_image_rows(
        since=now - dt.timedelta(minutes=1), until=now + dt.timedelta(minutes=1),
        tenants=[world.alice]))) == this_month
    assert len(rows) == 2
