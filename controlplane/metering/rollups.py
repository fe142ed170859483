"""The usage rollups: hourly and daily totals per tenant and tier, and the daily histogram of
image costs, kept up to date from the events past a watermark."""

from __future__ import annotations

import datetime as dt
import logging

from django.db import connection, transaction
from django.db.models import Count, F, Max, Min, Q, Sum, Value
from django.db.models.functions import Coalesce, TruncDate, TruncHour
from django.utils import timezone

from controlplane.metering.models import (
    TOTALS,
    DailyUsage,
    HourlyUsage,
    ImageCostHistogram,
    RetiredMonth,
    RollupState,
    UsageEvent,
    UsageImage,
)
from controlplane.metering.ratebook import RateBook
from controlplane.metering.services import billed

log = logging.getLogger(__name__)
# Events are stamped before they commit; a slow commit can land behind the watermark. Each
# run looks back this far again (recomputing a day is idempotent, so overlap costs little).
ROLLUP_OVERLAP = dt.timedelta(minutes=5)


def rollup_daily(*, now: dt.datetime | None = None) -> int:
    """Recompute the daily totals of every day that received events since the last run, and
    that day's cost-per-image histogram.

    Recomputing a whole period makes the run idempotent, and a late event (recorded today,
    dated yesterday) reopens its own day. A day's totals are the sums of its hours' (the
    hourly rollup is brought up to date first), so the events are read once, by the hourly
    rollup, not again for each day. Returns the days rewritten.
    """
    now = now or timezone.now()
    rollup_hourly(now=now)
    return _rollup("daily", DailyUsage, "day", TruncDate, dt.timedelta(days=1), now, source=_days_from_hours,
                   also=_image_costs_rewrite)


def rollup_hourly(*, now: dt.datetime | None = None) -> int:
    """The same per hour, from the events. Returns the hours rewritten."""
    return _rollup("hourly", HourlyUsage, "hour", TruncHour, dt.timedelta(hours=1), now, source=_hours_from_events)


def _rollup(name, model, field, trunc, length, now, *, source, also=None) -> int:
    now = now or timezone.now()
    with transaction.atomic():
        with connection.cursor() as cursor:
            _analytic(cursor)
        state, _ = RollupState.objects.select_for_update().get_or_create(name=name)
        # Events recorded up to a moment ago; anything still being written lands next run.
        upto = now - dt.timedelta(seconds=1)
        full = state.watermark is None
        if full:
            periods = _every_period(field, length, upto)
        else:
            new = UsageEvent.objects.filter(recorded_at__lte=upto, recorded_at__gt=state.watermark - ROLLUP_OVERLAP)
            periods = sorted(new.annotate(period=trunc("created_at", tzinfo=dt.UTC))
                             .values_list("period", flat=True).order_by().distinct())
        periods = _open(periods)
        if periods:
            # The periods' rows are replaced in two statements, the new ones computed and
            # written by the database itself (INSERT ... SELECT: no row comes into Python).
            # An upsert would not do: the unique constraint never matches rows without a key,
            # as NULLs are distinct.
            model.objects.filter(**{f"{field}__in": periods}).delete()
            _insert_select(model, [field, "tenant_id", "api_key_id", "tier_id", *TOTALS], source(periods, length))
            if also is not None:
                also(periods, full=full)
        state.watermark = upto if full else max(state.watermark, upto)
        state.ran_at = now
        state.save()
    return len(periods)


def _open(periods: list) -> list:
    """The periods not in a retired month. Those months' events were dropped once found equal to
    their rollups, which are now their statements' record: a period of them recomputed from
    whatever came since would overwrite it. Usage arriving that late is left out, and said so."""
    retired = {(day.year, day.month) for day in RetiredMonth.objects.values_list("month", flat=True)}
    late = [period for period in periods if (period.year, period.month) in retired]
    if late:
        log.error("usage recorded for retired months, left out of the rollups: %s", late[:5])
    return [period for period in periods if (period.year, period.month) not in retired]


def _every_period(field: str, length: dt.timedelta, upto: dt.datetime) -> list:
    """Every hour (or day, by `field`) with events recorded by `upto`, named as TruncHour (or
    TruncDate) names it, found by walking the events' index on created_at from one period to the next: a lookup per period
    (hundreds), where a DISTINCT over the events read every one of them (seconds at ten
    million)."""
    events = UsageEvent.objects.filter(recorded_at__lte=upto).order_by("created_at").values_list("created_at",
                                                                                                 flat=True)
    periods, at = [], events.first()
    while at is not None:
        at = at.astimezone(dt.UTC)
        periods.append(at.date() if field == "day" else at.replace(minute=0, second=0, microsecond=0))
        at = events.filter(created_at__gte=_start(periods[-1]) + length).first()
    return periods


_SUMMED = (("images", "image_count"), ("image_tokens", "image_tokens"), ("cached_tokens", "cached_tokens"),
           ("cached_image_tokens", "cached_image_tokens"), ("text_tokens", "text_tokens"),
           ("output_tokens", "output_tokens"), ("cost", "cost"), ("cache_savings", "cache_savings"))


def _insert_select(model, columns: list[str], rows) -> None:
    """Insert what the `rows` query selects (its columns in the order of `columns`)."""
    sql, params = rows.query.sql_with_params()
    names = ", ".join(connection.ops.quote_name(model._meta.get_field(c).column) for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({names}) {sql}", params)


def _start(period) -> dt.datetime:
    return period if isinstance(period, dt.datetime) else dt.datetime.combine(period, dt.time.min, tzinfo=dt.UTC)


def _within(periods: list, length: dt.timedelta, field: str) -> Q:
    """`field` inside one of the (sorted) periods: a range per run of consecutive periods,
    which an index walks, rather than a test of each row against the list of periods."""
    runs, first, last = Q(), None, None
    for period in periods:
        start = _start(period)
        if last is not None and start == last:
            last = start + length
            continue
        if first is not None:
            runs |= Q(**{f"{field}__gte": first, f"{field}__lt": last})
        first, last = start, start + length
    return runs | Q(**{f"{field}__gte": first, f"{field}__lt": last})


def _analytic(cursor) -> None:
    """Settings for a rollup run's few large grouped queries, in its transaction only: memory
    to group in (not on disk), no JIT compilation (seconds of it, for queries run once), and
    parallel workers where they pay."""
    if connection.vendor == "postgresql":
        cursor.execute("SET LOCAL work_mem = '64MB'")
        cursor.execute("SET LOCAL jit = off")
        # Joins and scans of millions of rows on every core the server offers (its defaults
        # keep the images' join with their events on one).
        cursor.execute("SET LOCAL parallel_setup_cost = 10")
        cursor.execute("SET LOCAL parallel_tuple_cost = 0.001")
        # Grouped by hashing, never by sorting: the planner takes the groups of a join (the
        # images' with their events) for as many as its rows, and would sort ten million rows
        # into a few thousand groups.
        cursor.execute("SET LOCAL enable_sort = off")


def _hours_from_events(hours: list, length: dt.timedelta):
    """Each hour's totals per tenant, key and tier, from its events: one grouped query for
    every hour at once (unbilled requests counted apart and adding nothing else)."""
    return (
        UsageEvent.objects.filter(_within(hours, length, "created_at"))
        .annotate(period=TruncHour("created_at", tzinfo=dt.UTC))
        .values("period", "tenant_id", "api_key_id", "tier_id")
        .annotate(**_totals(requests=Count("id"), unbilled_requests=Count("id", filter=~billed()),
                            **{name: Coalesce(Sum(column, filter=billed()), Value(0),
                                                output_field=UsageEvent._meta.get_field(column))
                               for name, column in _SUMMED}))
        .order_by()
    )


def _days_from_hours(days: list, length: dt.timedelta):
    """Each day's totals per tenant, key and tier: the sums of its hours'."""
    return (
        HourlyUsage.objects.filter(_within(days, length, "hour"))
        .annotate(period=TruncDate("hour", tzinfo=dt.UTC))
        .values("period", "tenant_id", "api_key_id", "tier_id")
        .annotate(**_totals(**{name: Sum(name) for name in TOTALS}))
        .order_by()
    )


def _totals(**aggregates) -> dict:
    """The aggregates in the order of TOTALS (the columns an INSERT ... SELECT names), each
    under a name of its own (a period's row field must not be shadowed by its sum)."""
    return {f"total_{name}": aggregates[name] for name in TOTALS}


def _image_costs_rewrite(days: list, *, full: bool = False) -> None:
    """Rewrite the days' cost-per-image histograms from their images: the images the
    per-image cost report lists (those of billed requests), each priced as it prices them, at
    the rate that priced its request.

    Images are counted in SQL by (day, tenant, tier, rate, tokens, cached tokens), every day
    in one query, and each such group is priced once, so the run reads no image row into
    Python however many there are.
    """
    book, bins = RateBook(), {}
    # An image carries its event's created_at: bounded by it too, only the days' months'
    # partitions of the images are read, not every month's.
    images = UsageImage.objects.filter(billed("event__"), _within(days, dt.timedelta(days=1), "event__created_at"),
                                       _within(days, dt.timedelta(days=1), "created_at"))
    if not full:
        # The days' events' ids bound their images' (a redundant condition, which lets the
        # images be read by their event's index rather than all of them scanned for a day's
        # few). (Of id + 0: a plain MIN(id) with a condition would walk the primary key from
        # the first event until one matched, nearly the whole table for today's events.) A full
        # run reads every image anyway.
        within = _within(days, dt.timedelta(days=1), "created_at")
        ids = UsageEvent.objects.filter(within).aggregate(low=Min(F("id") + 0), high=Max(F("id") + 0))
        if ids["low"] is None:
            ImageCostHistogram.objects.filter(day__in=days).delete()
            return
        images = images.filter(event_id__gte=ids["low"], event_id__lte=ids["high"])
    groups = (
        images
        .annotate(day=TruncDate("event__created_at", tzinfo=dt.UTC))
        .values("day", "event__tenant_id", "event__tier_id", "event__rate_id", "tokens", "cached_tokens")
        .annotate(count=Count("id"))
        .order_by()
    )
    for group in groups:
        each = book.image_price(group["event__rate_id"], group["tokens"], group["cached_tokens"])
        key = (group["day"], group["event__tenant_id"], group["event__tier_id"], ImageCostHistogram.bucket(each))
        row = bins.get(key)
        if row is None:
            row = bins[key] = ImageCostHistogram(day=key[0], tenant_id=key[1], tier_id=key[2], cost_from=key[3])
        row.images += group["count"]
        row.image_tokens += group["count"] * group["tokens"]
        row.cost += group["count"] * (each or 0)
    ImageCostHistogram.objects.filter(day__in=days).delete()
    ImageCostHistogram.objects.bulk_create(bins.values(), batch_size=5000)
