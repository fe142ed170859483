"""Finance exports, streamed row by row so memory stays flat at millions of rows."""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools
from collections.abc import Iterator

from controlplane.catalog.models import PriceRate
from controlplane.metering.models import UsageImage
from controlplane.metering.rating import Usage, price

IMAGE_COLUMNS = ["tenant", "request_id", "time", "tier", "source_width", "source_height", "sent_width",
                 "sent_height", "image_tokens", "cache_hit", "cost_usd"]


class _RateBook:
    """The rate in effect for a plan at a moment, without a query per row."""

    def __init__(self):
        self._rates: dict[int, list[PriceRate]] = {}

    def at(self, plan_id: int, when: dt.datetime):
        rates = self._rates.get(plan_id)
        if rates is None:
            rates = self._rates[plan_id] = list(PriceRate.objects.filter(plan_id=plan_id).order_by("-effective_from"))
        return next((r.as_rates() for r in rates if r.effective_from <= when), None)


def per_image_rows(*, since: dt.datetime, until: dt.datetime, tenants) -> Iterator[list]:
    """One row per image sent to an engine: what it was, what it became, what it cost."""
    rates = _RateBook()
    images = (UsageImage.objects.filter(event__created_at__gte=since, event__created_at__lt=until,
                                        event__tenant__in=tenants)
              .exclude(event__status="error")
              .select_related("event__tenant", "event__tier")
              .order_by("event__created_at", "event_id", "position"))
    for image in images.iterator(chunk_size=2000):
        event = image.event
        rate = rates.at(event.tier.price_plan_id, event.created_at)
        cost = "" if rate is None else price(Usage(image_tokens=image.tokens, images=1,
                                                   cached_image_tokens=image.tokens if image.cached else 0), rate)
        yield [event.tenant.name, event.request_id, event.created_at.isoformat(), event.tier.name,
               image.source_width, image.source_height, image.width, image.height, image.tokens,
               "yes" if image.cached else "no", cost]


def csv_lines(header: list[str], rows: Iterator[list]) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    yield buffer.getvalue().encode()
    for row in rows:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow(row)
        yield buffer.getvalue().encode()


async def in_batches(lines: Iterator[bytes], size: int = 1000):
    """Serve a synchronous row generator under ASGI without reading it all into memory
    (Django would): batches are pulled on one thread, which also keeps the database cursor."""
    from asgiref.sync import sync_to_async

    def take():
        return b"".join(itertools.islice(lines, size))

    while chunk := await sync_to_async(take)():
        yield chunk
