"""Usage recorded: each request's record priced at the rate in effect and stored once, in bulk
from the usage stream or one at a time, and what has been billed so far."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.metering.periods import period_start
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import Rates
from controlplane.metering.records import (
    CUT_SHORT,
    UsageRecord,
    image_lines,
    is_billable,
    priced_lines,
    record_price,
)

log = logging.getLogger(__name__)
MICROS = 1_000_000  # micro-units in a unit of a currency



def billed(path: str = "") -> Q:
    """is_billable as a filter on usage events; `path` reaches them from another model
    ("event__" from their images). (An event without a tier is never completed nor worked on
    by an engine: the tier needs no test of its own here.)"""
    return Q(**{f"{path}status": "ok"}) | Q(**{f"{path}status__in": CUT_SHORT, f"{path}instance__isnull": False})


def metered_so_far(tenant_id: int, period: str, now: dt.datetime) -> tuple[int, int]:
    """Image and total tokens the tenant has used this period, as quotas count them: only
    billed requests. A quota counter starts from this at the start of a period."""

    totals = UsageEvent.objects.filter(billed(), tenant_id=tenant_id, created_at__gte=period_start(period, now)).aggregate(
        **metered_sums())
    return int(totals["image"] or 0), int(totals["total"] or 0)


@dataclass(frozen=True)
class Metered:
    """What a tenant has used this period as its quota and budgets count it: image and total
    tokens, and spend by counter ('tenant', and 'k<key id>' per key) in micro-units."""

    image_tokens: int
    total_tokens: int
    spent: dict[str, int]


def metered_usage(tenant_id: int, period: str, now: dt.datetime, currency: str) -> Metered:
    """What the tenant has used this period as its quota and budgets count it, in one query:
    billed requests' image and total tokens, and what it and each of its keys spent in
    `currency` (micro-units) at the price they were billed."""
    rows = (UsageEvent.objects.filter(billed(), tenant_id=tenant_id, created_at__gte=period_start(period, now))
            .values("api_key_id").order_by()
            .annotate(**metered_sums(), cost=Sum("cost", filter=Q(rate__plan__currency=currency))))
    spent = {f"k{row['api_key_id'] or 0}": int((row["cost"] or 0) * MICROS) for row in rows}
    spent["tenant"] = sum(spent.values())
    return Metered(sum(int(row["image"] or 0) for row in rows), sum(int(row["total"] or 0) for row in rows), spent)


def metered_spend(tenant_id: int, period: str, now: dt.datetime, currency: str) -> dict[str, int]:
    """What the tenant ('tenant') and each of its keys ('k<id>') spent this period in `currency`."""
    return metered_usage(tenant_id, period, now, currency).spent


def pending_prices(records: list[UsageRecord], currency: str) -> list[int]:
    """What each of `records`, not yet stored, will be billed in `currency` (micro-units; 0 when
    not billed, not priced, or priced in another currency), in two queries for them all."""
    plans = dict(ModelTier.objects.filter(pk__in={r.tier_id for r in records}).values_list("pk", "price_plan_id"))
    book = RateBook().load(set(plans.values()))
    prices = []
    for record in records:
        try:
            rate = book.rate_at(plans.get(record.tier_id), record.created_at) if is_billable(record) else None
        except NoRate:
            rate = None
        priced = rate is not None and rate.plan.currency == currency
        prices.append(int(record_price(record, Rates.of(rate)) * MICROS) if priced else 0)
    return prices


def metered_sums(**options) -> dict:
    """What quotas count, as aggregates named image and total: image tokens, and every token.
    `options` go to each Sum (a `filter`, for one sum among others)."""
    return {"image": Sum("image_tokens", **options),
            "total": Sum(F("image_tokens") + F("text_tokens") + F("output_tokens"), **options)}


def usage_record(*, record: UsageRecord) -> UsageEvent:
    """Store one request's usage. Recording the same request id twice stores it once."""
    existing = UsageEvent.objects.filter(request_id=record.request_id).first()
    if existing is not None:
        return existing
    tier = None if record.tier_id is None else ModelTier.objects.get(pk=record.tier_id)
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
    tiers = ModelTier.objects.in_bulk({record.tier_id for record in fresh} - {None})
    book = RateBook().load({tier.price_plan_id for tier in tiers.values()})
    rows = []
    for record in fresh:
        tier = tiers.get(record.tier_id)
        if tier is None and record.tier_id is not None:
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


def _usage_rows(record: UsageRecord, tier: ModelTier | None, book: RateBook) -> tuple[UsageEvent, list[UsageImage]]:
    """The unsaved event and image rows for a record, priced at the rate in effect when it was made."""
    event_values, image_values = _usage_values(record, tier, book)
    event = UsageEvent(**event_values)
    return event, [UsageImage(event=event, **values) for values in image_values]


def _usage_values(record: UsageRecord, tier: ModelTier | None, book: RateBook) -> tuple[dict, list[dict]]:
    """The columns of a record's event and of each of its images, priced at the rate in effect
    when it was made: what either way of storing them (one by one, or copied in bulk) writes.
    A record without a tier (refused before its model was known) is never billed.
    The ingest makes these thousands of times a second: dict displays, and each line walked
    once."""
    record.images = image_lines(record.images)
    lines, unlined = priced_lines(record)
    cached_image = unlined[1]
    images, kept = [], []
    for position, ((image, tokens, _), (_, cached)) in enumerate(zip(record.images, lines, strict=True)):
        cached_image += cached
        kept.append((image, tokens, cached))
        images.append({
            "created_at": record.created_at,
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
        "error_stage": record.error_stage,
        "error_code": record.error_code,
        "error_message": record.error_message,
        "error_param": record.error_param,
        "routed_by": record.routed_by,
        "cascade_of": record.cascade_of,
        "escalation": record.escalation,
        "confidence": record.confidence,
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
