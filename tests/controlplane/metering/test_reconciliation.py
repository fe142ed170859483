"""A month closed by finance: every figure of every report agrees with every other, to the
micro-dollar, over generated months with a mid-month price change, a tier moved to another plan
mid-month, cache hits (whole and partial), failures, interruptions, aborted requests, long
images cut into tiles and a tier priced only from the third day (its first requests unrated).

What each figure includes (one meaning each, docs/finance.md "What each figure includes"):
- a usage event's cost: what the request is billed at the rate it names; 0 for requests refused
  or failed before an engine worked on them; aborted and interrupted requests are billed for
  what the engine did;
- a statement, `/api/v1/cost/`, the monthly summary and the usage page: sums of billed
  requests' costs, in each currency apart; requests not billed are counted apart;
- the per-image report: one row per image of a billed request, priced on its own (its cached
  share discounted, its fee included) at the rate its request names;
- the cost-per-image histogram: the per-image report's images and costs, binned per day.

The month generated is the current one (from its first instant to now), so that the pages and
APIs that show "this month" are compared too.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import random
from decimal import Decimal

import openpyxl
import pytest
from django.utils import timezone

from controlplane.catalog.models import PricePlan, PriceRate
from controlplane.fleet.models import EngineInstance
from controlplane.metering.exports import (
    IMAGE_COLUMNS,
    SUMMARY_COLUMNS,
    monthly_summary_rows,
    per_image_rows,
)
from controlplane.metering.models import ImageCostHistogram, UsageEvent
from controlplane.metering.periods import month_bounds
from controlplane.metering.rating import MICRO, Rates, price_parts
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import billed, usage_record, usage_record_many
from controlplane.metering.statements import statement
from controlplane.tenants.models import Tenant
from tests.factories import VisionTierFactory

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]

PICTURE = ImageLine(source_format="jpeg", source_width=1920, source_height=1080, width=1316, height=728,
                    fingerprint="0" * 16)


def _tile(n, of):
    return ImageLine(source_format="png", source_width=800, source_height=9000, width=392, height=1428,
                     fingerprint=f"{n:016x}", tile=n, tiles=of)


class Month:
    """The current month so far, generated: its bounds and the moments prices changed."""

    def __init__(self, world, seed, count):
        self.now = timezone.now()
        self.start, self.end = month_bounds(self.now.year, self.now.month)
        span = (self.now - self.start).total_seconds()
        self.rng = random.Random(seed)
        self.at = lambda share: self.start + dt.timedelta(seconds=span * share)
        self.world, self.count = world, count
        instance = EngineInstance.objects.create(tier=world.vision)
        # A tier whose plan had no rate until a third of the way in: its first requests are unrated.
        late = PricePlan.objects.create(name="late-priced")
        self.late_tier = VisionTierFactory(name="vlm-late", price_plan=late)
        records = [self._request(n, instance) for n in range(count)]
        records.sort(key=lambda r: r.created_at)
        # Recorded in time order, prices changing in between, as ingest meets them.
        steps = [(self.at(0.3), lambda: PriceRate.objects.create(
                      plan=late, effective_from=self.at(0.3), image_per_mtok=Decimal("0.70"),
                      per_image_fee=Decimal("0.0005"), text_input_per_mtok=Decimal("0.3"))),
                 (self.at(0.5), lambda: PriceRate.objects.create(
                     plan=world.vision.price_plan, effective_from=self.at(0.5), text_input_per_mtok=Decimal("0.25"),
                     image_per_mtok=Decimal("0.45"), output_per_mtok=Decimal("0.90"), per_image_fee=Decimal("0.002"),
                     cached_image_discount=Decimal("0.6"))),
                 (self.at(0.7), self._move_vision_to_another_plan)]
        batch = []
        for record in records:
            while steps and record.created_at >= steps[0][0]:
                self._store(batch)
                batch = []
                steps.pop(0)[1]()
            batch.append(record)
        self._store(batch)
        rollup_daily(now=timezone.now() + dt.timedelta(seconds=2))  # events recorded a moment ago too

    def _store(self, records):
        """Both ways in: the batch ingest and one by one."""
        half = len(records) // 2
        if records[:half]:
            usage_record_many(records=records[:half])
        for record in records[half:]:
            usage_record(record=record)

    def _move_vision_to_another_plan(self):
        plan = PricePlan.objects.create(name="vision-2", currency="USD")
        PriceRate.objects.create(plan=plan, effective_from=self.start - dt.timedelta(days=1),
                                 image_per_mtok=Decimal("0.35"), text_input_per_mtok=Decimal("0.22"),
                                 output_per_mtok=Decimal("0.7"), per_image_fee=Decimal("0.0015"),
                                 cached_image_discount=Decimal("0.8"))
        self.world.vision.price_plan = plan
        self.world.vision.full_clean()
        self.world.vision.save()

    def _request(self, n, instance) -> UsageRecord:
        rng, world = self.rng, self.world
        tier = rng.choices([world.vision, world.text, self.late_tier], weights=[6, 3, 1])[0]
        images = []
        if tier.kind == "vision":
            if rng.random() < 0.2:  # a long image cut into tiles, each its own line
                tiles = rng.choice([2, 3, 5])
                images = [(_tile(k, tiles), 1020, 0) for k in range(tiles)]
            else:
                for _ in range(rng.choice([1, 1, 1, 2, 3])):
                    tokens = rng.choice([66, 258, 1224, 1232, 4096])
                    images.append((PICTURE, tokens, 0))
            # The engine's cached prefix covers the first images, the last one perhaps in part.
            cached = rng.choice([0, 0, sum(t for _, t, _ in images), rng.randint(0, sum(t for _, t, _ in images))])
            for k, (line, tokens, _) in enumerate(images):
                share = min(tokens, cached)
                images[k] = (line, tokens, share)
                cached -= share
        status, engine = rng.choice([("ok", instance)] * 8 + [("error", None), ("aborted", None),
                                                               ("aborted", instance), ("interrupted", instance)])
        return UsageRecord(
            request_id=f"r{n}", tenant_id=rng.choice([world.alice, world.bob]).pk, api_key_id=None, tier_id=tier.pk,
            status=status, http_status=502 if status == "error" else 200, instance_id=engine.pk if engine else None,
            images=images, image_tokens=sum(t for _, t, _ in images), cached_image_tokens=sum(c for _, _, c in images),
            text_tokens=rng.randint(0, 3000), output_tokens=rng.randint(0, 900),
            created_at=self.at(rng.random() * 0.999))

    def events(self, tenant):
        return UsageEvent.objects.filter(tenant=tenant, created_at__gte=self.start, created_at__lt=self.end)


def _rates_when_made(event):
    """Looked up here on its own, not through the rate book the code under test uses: the rate
    of the plan the tier was on when the request was recorded, in effect when it was made."""
    return Rates.of(PriceRate.objects.get(pk=event.rate_id))


def _text_and_output_parts(events) -> Decimal:
    total = Decimal(0)
    for event in events.filter(billed()).exclude(rate=None):
        parts = price_parts(images=[], text_tokens=event.text_tokens, output_tokens=event.output_tokens,
                            rates=_rates_when_made(event))
        total += parts.text + parts.output
    return total


def _csv(response):
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def _xlsx(response, sheet):
    book = openpyxl.load_workbook(io.BytesIO(b"".join(response.streaming_content)), read_only=True)
    rows = list(book[sheet].iter_rows(values_only=True))
    return [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


def _money(value) -> Decimal:
    """A cell read back: CSV text to the micro-unit, or an XLSX float rounded to it."""
    return Decimal(repr(value) if isinstance(value, float) else value).quantize(MICRO)


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_a_closed_month_reconciles_to_the_micro_dollar_across_every_report(client, world, seed):
    month = Month(world, seed, count=240)
    period = f"{month.now:%Y-%m}"
    client.force_login(world.finance)
    images_csv = _csv(client.get("/api/v1/exports/images.csv", {"month": period}))
    images_xlsx = _xlsx(client.get("/api/v1/exports/images.xlsx", {"month": period}), "Images")
    summary_csv = _csv(client.get("/api/v1/exports/monthly-summary.csv", {"month": period}))
    summary_xlsx = _xlsx(client.get("/api/v1/exports/monthly-summary.xlsx", {"month": period}), "Monthly summary")
    assert list(images_csv[0]) == IMAGE_COLUMNS and list(summary_csv[0]) == SUMMARY_COLUMNS
    images_total = Decimal(0)
    for tenant, key in ((world.alice, world.alice_key), (world.bob, world.bob_key)):
        events = month.events(tenant)
        assert events.filter(rated=False).exists() and events.filter(cached_image_tokens__gt=0).exists()
        bill = statement(tenant=tenant, year=month.now.year, month=month.now.month)
        assert bill["currency"] == "USD"
        # statement = Σ events = Σ its lines
        assert bill["total"] == sum(e.cost for e in events) > 0
        assert bill["total"] == sum((line["cost"] for line in bill["lines"]), Decimal(0))
        assert bill["cache_savings"] == sum(e.cache_savings for e in events) > 0
        assert bill["unrated_requests"] == events.filter(rated=False).count()
        assert bill["unbilled_requests"] == events.exclude(billed()).count()
        # Σ per-image rows + text and output parts = statement; one row per image of a billed request
        tenants = Tenant.objects.filter(pk=tenant.pk)
        per_image = list(per_image_rows(since=month.start, until=month.end, tenants=tenants))
        assert len(per_image) == sum(e.image_count for e in events.filter(billed())) \
            == sum(line["images"] for line in bill["lines"])
        cost = IMAGE_COLUMNS.index("cost")
        priced = sum((row[cost] for row in per_image if row[cost] is not None), Decimal(0))
        assert priced + _text_and_output_parts(events) == bill["total"]
        images_total += priced
        # the per-image files, CSV and XLSX, say the same
        for rows in (images_csv, images_xlsx):
            mine = [r for r in rows if r["tenant"] == tenant.name]
            assert len(mine) == len(per_image)
            assert sum(_money(r["cost"]) for r in mine if r["cost"] not in ("", None)) == priced
        # the monthly summary, from the rollups, in both files
        summary = {row[2]: row for row in monthly_summary_rows(first=month.start.date(), last=month.now.date(),
                                                               tenants=tenants)}
        assert summary["total"][SUMMARY_COLUMNS.index("cost")] == bill["total"]
        assert summary["total"][SUMMARY_COLUMNS.index("cache_savings")] == bill["cache_savings"]
        assert summary["total"][SUMMARY_COLUMNS.index("images")] == len(per_image)
        assert summary["total"][SUMMARY_COLUMNS.index("requests")] == sum(line["requests"] for line in bill["lines"])
        for rows in (summary_csv, summary_xlsx):
            total = next(r for r in rows if r["tenant"] == tenant.name and r["line"] == "total")
            assert _money(total["cost"]) == bill["total"] and total["currency"] == "USD"
        # the statement and cost APIs, with the tenant's own key
        auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
        api = client.get(f"/api/v1/statements/{period}/", **auth).json()
        assert Decimal(api["total"]) == bill["total"] and Decimal(api["cache_savings"]) == bill["cache_savings"]
        assert all(len(line["cost"].split(".")[1]) == 6 for line in api["lines"])
        cost = client.get("/api/v1/cost/", **auth).json()
        assert Decimal(cost["cost"]) == bill["total"]
        assert cost["requests"] == sum(line["requests"] for line in bill["lines"])
        assert cost["images"] == len(per_image)
        # the usage page, filtered to the tenant, over a period holding the whole month: to the cent
        page = client.get("/", {"tenant": tenant.name, "period": "90d"}).content.decode()
        cards = page.split('id="usage-totals"')[1].split("</div>\n</div>")[0]
        assert f"<span>{bill['total']:,.2f} USD</span>cost" in cards
        assert f"<span>{bill['cache_savings']:,.2f} USD</span>saved by cached images" in cards
    # the cost-per-image histogram holds the per-image report's images and cost
    histogram = ImageCostHistogram.objects.filter(day__gte=month.start.date(), day__lt=month.end.date())
    assert sum(row.cost for row in histogram) == images_total
    assert sum(row.images for row in histogram) == len(images_csv)


def test_the_cached_share_of_an_image_is_what_its_discount_saved(world):
    Month(world, seed=5, count=60)
    events = UsageEvent.objects.filter(billed(), cached_image_tokens__gt=0, rate__cached_image_discount__gt=0)
    assert events.exists()
    for event in events:
        rates = _rates_when_made(event)
        lines = [(image.tokens, image.cached_tokens) for image in event.images.order_by("position")]
        assert event.cached_image_tokens == sum(cached for _, cached in lines)
        full = price_parts(images=[(tokens, 0) for tokens, _ in lines], text_tokens=event.text_tokens,
                           output_tokens=event.output_tokens, rates=rates).total
        assert event.cache_savings == full - event.cost > 0
