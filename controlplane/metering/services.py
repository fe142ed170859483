from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, Max, Min, Q, Sum, Value
from django.db.models.functions import Coalesce, TruncDate, TruncHour
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import (
    TOTALS,
    DailyUsage,
    HourlyUsage,
    ImageCostHistogram,
    RollupState,
    UsageEvent,
    UsageImage,
)
from controlplane.metering.periods import period_start
from controlplane.metering.ratebook import NoRate, RateBook

log = logging.getLogger(__name__)
# Events are stamped before they commit; a slow commit can land behind the watermark. Each
# run looks back this far again (recomputing a day is idempotent, so overlap costs little).
ROLLUP_OVERLAP = dt.timedelta(minutes=5)


@dataclass
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    tier_id: int
    stream: bool = False
    images: list = field(default_factory=list)  # (NormalisedImage, tokens, of which from the prefix cache)
    image_tokens: int = 0
    text_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine reused from its prefix cache
    cached_image_tokens: int = 0  # of which image tokens (each image's share of the cached prefix)
    # The engine's own count of image tokens (vLLM's multimodal_tokens.image), None when it
    # reported none; and whether it disagrees with the gateway's image_tokens.
    engine_image_tokens: int | None = None
    image_tokens_disagree: bool = False
    # The gateway's own prompt count before forwarding (text and images), and whether its
    # text part was the estimate rather than the tier's tokenizer's exact count.
    counted_prompt_tokens: int | None = None
    prompt_estimated: bool = True
    instance_id: int | None = None
    status: str = "ok"
    http_status: int = 200
    latency_ms: int = 0  # from arrival at the gateway to the last byte of the answer
    # Where the time went: preparing the images (decode, resize, count), waiting in the
    # gateway (admission, a large-image turn) before an engine was sent the request, and
    # from arrival to the first token streamed (None when not streamed or never reached).
    prepare_ms: int | None = None
    queue_ms: int | None = None
    ttft_ms: int | None = None
    created_at: dt.datetime = field(default_factory=timezone.now)
    reservation: object = None  # the quota reservation to settle (gateway only)
    # The checks of its images sent as they came (gateway only): its image lines get their
    # fingerprints from them, whether or not they had finished when it was admitted.
    checking: object = None
    # Its admission, when that ran beside the engine's work (gateway only): the record is
    # handed over once the admission has its answer.
    admission: object = None
    recorded: bool = False  # set once the gateway has handed the record over


_SCALARS = ("request_id", "tenant_id", "api_key_id", "tier_id", "stream", "image_tokens", "text_tokens",
            "output_tokens", "cached_tokens", "cached_image_tokens", "instance_id", "status", "http_status",
            "latency_ms", "engine_image_tokens", "image_tokens_disagree", "counted_prompt_tokens", "prompt_estimated",
            "prepare_ms", "queue_ms", "ttft_ms")
# Fields newer than some records already in flight (streams and journals outlive a deploy).
_SCALAR_DEFAULTS = {"engine_image_tokens": None, "image_tokens_disagree": False, "counted_prompt_tokens": None,
                    "prompt_estimated": True, "prepare_ms": None, "queue_ms": None, "ttft_ms": None}
_IMAGE_FIELDS = ("source_format", "source_width", "source_height", "width", "height", "fingerprint", "tile", "tiles")


class ImageLine(NamedTuple):
    """What metering keeps of an image (never its pixels). A named tuple: the ingest makes
    thousands a second, and a frozen dataclass costs five times as much to make."""

    source_format: str
    source_width: int
    source_height: int
    width: int
    height: int
    fingerprint: str
    tile: int = 0  # its place among the tiles of a long picture cut by the policy
    tiles: int = 1


def usage_to_json(record: UsageRecord) -> dict:
    """A record as plain JSON, for the usage stream."""
    data = {name: getattr(record, name) for name in _SCALARS}
    data["created_at"] = record.created_at.isoformat()
    data["images"] = [[{f: getattr(image, f) for f in _IMAGE_FIELDS}, tokens, cached]
                      for image, tokens, cached in _lines(record.images)]
    return data


_REQUIRED = tuple(name for name in _SCALARS if name not in _SCALAR_DEFAULTS)


def usage_from_json(data: dict) -> UsageRecord:
    values = {name: data[name] for name in _REQUIRED}
    for name, default in _SCALAR_DEFAULTS.items():
        values[name] = data.get(name, default)
    record = UsageRecord(**values, created_at=dt.datetime.fromisoformat(data["created_at"]))
    record.images = _lines([(ImageLine(**image), tokens, cached) for image, tokens, cached in data["images"]])
    return record


def _lines(images: list) -> list:
    """(image, tokens, cached tokens) lines. A pair is an image none of which came from the
    cache; a flag (records made before shares were kept) means all of it or none."""
    lines = []
    for item in images:
        image, tokens, cached = item if len(item) == 3 else (*item, 0)
        if isinstance(cached, bool):
            cached = tokens if cached else 0
        lines.append((image, tokens, int(cached)))
    return lines


def is_billable(record: UsageRecord) -> bool:
    """Completed work is billed, and so is work an engine did for a client that left; a request
    refused or failed before an engine worked on it is not. Work interrupted by a gateway crash
    is billed as far as its journal knew."""
    return record.status == "ok" or (record.status in _CUT_SHORT and record.instance_id is not None)


_CUT_SHORT = ("aborted", "interrupted")  # billed only if an engine worked on them


def billed(path: str = "") -> Q:
    """is_billable as a filter on usage events; `path` reaches them from another model
    ("event__" from their images)."""
    return Q(**{f"{path}status": "ok"}) | Q(**{f"{path}status__in": _CUT_SHORT, f"{path}instance__isnull": False})


def metered_so_far(tenant_id: int, period: str, now: dt.datetime) -> tuple[int, int]:
    """Image and total tokens the tenant has used this period, as quotas count them: only
    billed requests. A quota counter starts from this at the start of a period."""
    from django.db.models import F

    totals = UsageEvent.objects.filter(billed(), tenant_id=tenant_id, created_at__gte=period_start(period, now)).aggregate(
        image=Sum("image_tokens"), total=Sum(F("image_tokens") + F("text_tokens") + F("output_tokens")))
    return int(totals["image"] or 0), int(totals["total"] or 0)


def usage_record(*, record: UsageRecord) -> UsageEvent:
    """Store one request's usage. Recording the same request id twice stores it once."""
    existing = UsageEvent.objects.filter(request_id=record.request_id).first()
    if existing is not None:
        return existing
    tier = ModelTier.objects.get(pk=record.tier_id)
    event, images = _usage_rows(record, tier, RateBook())
    try:
        with transaction.atomic():
            event.save(force_insert=True)
            UsageImage.objects.bulk_create(images)
    except IntegrityError:
        # A concurrent writer stored the same request id first: that copy is the record.
        return UsageEvent.objects.get(request_id=record.request_id)
    return event


def usage_record_many(*, records: list[UsageRecord]) -> int:
    """Store many requests' usage in one transaction, a few queries for the whole batch.

    Idempotent by request id like usage_record: ids already stored, or repeated within the
    batch, are stored once (the first copy wins). All or nothing: if any record cannot be
    stored, or a concurrent writer stores one of the ids meanwhile, it raises and stores none,
    and the caller falls back to usage_record one by one. Returns the events newly stored.
    """
    return usage_rows_store(usage_rows(records))


def usage_rows(records: list[UsageRecord]) -> list[tuple[dict, list[dict]]]:
    """The first half of usage_record_many: the rows (event and images) of the records not
    stored yet, each priced. Reads the database; writes nothing."""
    batch = {}
    for record in records:
        batch.setdefault(record.request_id, record)
    stored = _stored_request_ids(list(batch))
    fresh = [record for request_id, record in batch.items() if request_id not in stored]
    if not fresh:
        return []
    tiers = ModelTier.objects.in_bulk({record.tier_id for record in fresh})
    book = RateBook().load({tier.price_plan_id for tier in tiers.values()})
    rows = []
    for record in fresh:
        tier = tiers.get(record.tier_id)
        if tier is None:
            raise ModelTier.DoesNotExist(f"no tier {record.tier_id} for {record.request_id}")
        rows.append(_usage_values(record, tier, book))
    return rows


def usage_rows_store(rows: list[tuple[dict, list[dict]]]) -> int:
    """The second half: the rows written in one transaction (all or none). Returns how many
    events."""
    if not rows:
        return 0
    with transaction.atomic():
        if connection.vendor == "postgresql":
            _copy_rows(rows)
        else:
            events = [UsageEvent(**event) for event, _ in rows]
            UsageEvent.objects.bulk_create(events)  # sets each event's id
            UsageImage.objects.bulk_create([UsageImage(event=event, **image) for event, (_, images)
                                            in zip(events, rows, strict=True) for image in images])
    return len(rows)


def _stored_request_ids(request_ids: list[str]) -> set[str]:
    if connection.vendor != "postgresql":
        return set(UsageEvent.objects.filter(request_id__in=request_ids).values_list("request_id", flat=True))
    # One array parameter rather than an IN list of thousands (which Django builds slowly).
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT request_id FROM {UsageEvent._meta.db_table} WHERE request_id = ANY(%s)",
                       [request_ids])
        return {request_id for (request_id,) in cursor.fetchall()}


def _copy_rows(rows: list[tuple[dict, list[dict]]]) -> None:
    """Events and their images by COPY, the fastest way into PostgreSQL (bulk_create's
    INSERT spends most of its time building model instances and SQL): the events' ids come
    from their sequence in one query, so the images can name their event in the same pass.
    In COPY's binary format, each column sent as its type: psycopg packs the values in half
    the Python time the text format takes (the writer shares the worker with the next batch's
    pricing), and nothing is lost or rounded (a test compares it with one by one)."""
    events, images = UsageEvent._meta.db_table, UsageImage._meta.db_table
    event_columns = ["id", "recorded_at", *rows[0][0]]
    first_image = next((lines[0] for _, lines in rows if lines), None)
    image_columns = ["event_id", *first_image] if first_image is not None else []
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(pg_get_serial_sequence(%s, 'id')) FROM generate_series(1, %s)",
                       [events, len(rows)])
        ids = [pk for (pk,) in cursor.fetchall()]
        cursor.execute("SELECT attrelid = %s::regclass, attname, atttypid FROM pg_attribute "
                       "WHERE attrelid IN (%s::regclass, %s::regclass) AND attnum > 0 AND NOT attisdropped",
                       [events, events, images])
        types = {(events if of_events else images, column): oid for of_events, column, oid in cursor.fetchall()}
        recorded, raw = timezone.now(), cursor.cursor
        # Every row's values are in the order of its keys, which _usage_values writes alike.
        with raw.copy(f"COPY {events} ({', '.join(event_columns)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types([types[events, column] for column in event_columns])
            for pk, (event, _) in zip(ids, rows, strict=True):
                copy.write_row((pk, recorded, *event.values()))
        if image_columns:
            with raw.copy(f"COPY {images} ({', '.join(image_columns)}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types([types[images, column] for column in image_columns])
                for pk, (_, lines) in zip(ids, rows, strict=True):
                    for line in lines:
                        copy.write_row((pk, *line.values()))


def _priced_lines(record: UsageRecord) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(tokens, cached) per image line as they are priced, the per-image report's way; and the
    image tokens (and cached) a record counts without lines.

    Lines carry their cached share. A record whose lines carry none but which counts cached
    image tokens (made before shares were kept) has them laid over its images in order, as
    a prefix cache covers a prompt from its start."""
    lines = [(tokens, min(cached, tokens)) for _, tokens, cached in record.images]
    cached = min(record.cached_image_tokens, record.image_tokens)
    if not lines:
        return [], (record.image_tokens, cached)
    if cached and not any(share for _, share in lines):
        spread = []
        for tokens, _ in lines:
            share = min(tokens, cached)
            spread.append((tokens, share))
            cached -= share
        lines = spread
    return lines, (0, 0)


def _usage_rows(record: UsageRecord, tier: ModelTier, book: RateBook) -> tuple[UsageEvent, list[UsageImage]]:
    """The unsaved event and image rows for a record, priced at the rate in effect when it was made."""
    event_values, image_values = _usage_values(record, tier, book)
    event = UsageEvent(**event_values)
    return event, [UsageImage(event=event, **values) for values in image_values]


def _usage_values(record: UsageRecord, tier: ModelTier, book: RateBook) -> tuple[dict, list[dict]]:
    """The columns of a record's event and of each of its images, priced at the rate in effect
    when it was made: what either way of storing them (one by one, or copied in bulk) writes.
    The ingest makes these thousands of times a second: dict displays, and each line walked
    once."""
    record.images = _lines(record.images)
    lines, unlined = _priced_lines(record)
    cached_image = unlined[1]
    images, kept = [], []
    for position, ((image, tokens, _), (_, cached)) in enumerate(zip(record.images, lines, strict=True)):
        cached_image += cached
        kept.append((image, tokens, cached))
        images.append({
            "position": position,
            "source_format": image.source_format,
            "source_width": image.source_width,
            "source_height": image.source_height,
            "width": image.width,
            "height": image.height,
            "tokens": tokens,
            "fingerprint": image.fingerprint,
            "tile": getattr(image, "tile", 0),
            "tiles": getattr(image, "tiles", 1),
            "cached": cached > 0,
            "cached_tokens": cached,
        })
    record.images = kept
    rated, cost, savings, rate_id = True, 0, 0, None
    if is_billable(record):
        try:
            rate_id = book.rate_at(tier.price_plan_id, record.created_at).pk
            cost = book.request_price(rate_id, lines, unlined=unlined, text_tokens=record.text_tokens,
                                      output_tokens=record.output_tokens)
            if cached_image:
                savings = book.request_price(rate_id, [(tokens, 0) for tokens, _ in lines], unlined=(unlined[0], 0),
                                             text_tokens=record.text_tokens, output_tokens=record.output_tokens) - cost
        except NoRate:
            # Never lose usage over a pricing gap: keep the event, flagged for rating.
            log.error("no price in effect for tier %s at %s; %s stored unrated",
                      tier.name, record.created_at, record.request_id)
            rated = False
    event = {
        "request_id": record.request_id,
        "created_at": record.created_at,
        "tenant_id": record.tenant_id,
        "api_key_id": record.api_key_id,
        "tier_id": record.tier_id,
        "instance_id": record.instance_id,
        "status": record.status,
        "http_status": record.http_status,
        "stream": record.stream,
        "latency_ms": record.latency_ms,
        "prepare_ms": record.prepare_ms,
        "queue_ms": record.queue_ms,
        "ttft_ms": record.ttft_ms,
        "image_count": len(images),
        "image_tokens": record.image_tokens,
        "cached_tokens": record.cached_tokens,
        "cached_image_tokens": cached_image,
        "engine_image_tokens": record.engine_image_tokens,
        "image_tokens_disagree": record.image_tokens_disagree,
        "counted_prompt_tokens": record.counted_prompt_tokens,
        "prompt_estimated": record.prompt_estimated,
        "text_tokens": record.text_tokens,
        "output_tokens": record.output_tokens,
        "cost": cost,
        "cache_savings": savings,
        "rated": rated,
        "rate_id": rate_id,
    }
    return event, images


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
    images = UsageImage.objects.filter(billed("event__"), _within(days, dt.timedelta(days=1), "event__created_at"))
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
