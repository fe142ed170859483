"""The daily rollup's cost-per-image histogram, against the real database."""

import datetime as dt
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.catalog.models import PricePlan, PriceRate
from controlplane.demo import PRICES_FROM
from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.exports import IMAGE_COLUMNS, per_image_rows
from controlplane.metering.models import ImageCostHistogram, RollupState, UsageEvent
from controlplane.metering.records import UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Tenant
from tests.factories import VisionTierFactory
from tests.images import image_bytes

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]


@pytest.fixture
def flagship(world):
    """A tier priced by image tokens alone (2 USD per million, no fee), cached images free."""
    plan = PricePlan.objects.create(name="flagship")
    PriceRate.objects.create(plan=plan, effective_from=PRICES_FROM, text_input_per_mtok=Decimal("1"),
                             image_per_mtok=Decimal("2"), output_per_mtok=Decimal("3"),
                             per_image_fee=Decimal("0"), cached_image_discount=Decimal("1"))
    return VisionTierFactory(name="vlm-flagship", price_plan=plan)


def _day(days_ago, hour, minute=0):
    today = timezone.now().astimezone(dt.UTC).date()
    return dt.datetime.combine(today - dt.timedelta(days=days_ago), dt.time(hour, minute), tzinfo=dt.UTC)


def _request(request_id, tenant, tier, when, images, status="ok"):
    """One request with `images`, a list of (tokens, served from the cache)."""
    picture = normalise(image_bytes(64, 64), Policy())
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=None, tier_id=tier.pk, status=status,
        http_status=200 if status == "ok" else 502,
        images=[(picture, tokens, cached) for tokens, cached in images],
        image_tokens=sum(tokens for tokens, _ in images),
        cached_image_tokens=sum(tokens for tokens, cached in images if cached),
        text_tokens=20, output_tokens=5, created_at=when))


def _roll_up(seconds_later=0):
    UsageEvent.objects.update(recorded_at=timezone.now() - dt.timedelta(minutes=10))
    return rollup_daily(now=timezone.now() + dt.timedelta(seconds=seconds_later))


def _histogram(**filters):
    return {
        (row.day, row.tenant.name, row.tier.name, ImageCostHistogram.label(row.cost_from)):
            (row.images, row.image_tokens, row.cost)
        for row in ImageCostHistogram.objects.filter(**filters).select_related("tenant", "tier")
    }


def test_each_image_lands_in_the_bucket_of_its_own_cost(world, flagship):
    day = _day(1, 10)
    _request("a-1", world.alice, flagship, day, [(1224, False), (1224, True), (5000, False)])
    _request("a-2", world.alice, flagship, day, [(1224, False)])
    _request("c-1", world.charlie, world.vision, day, [(1224, False), (1224, True)])

    assert _roll_up() == 1

    assert _histogram() == {
        # 1224 x 2 USD per million = 0.002448, twice
        (day.date(), "alice", "vlm-flagship", "0.002–0.003"): (2, 2448, Decimal("0.004896")),
        # cached images are free on this plan
        (day.date(), "alice", "vlm-flagship", "0"): (1, 1224, Decimal("0")),
        (day.date(), "alice", "vlm-flagship", "0.01–0.015"): (1, 5000, Decimal("0.010000")),
        # 0.30 per million, half off when cached, plus 0.001 per image: 0.001367 and 0.001184
        (day.date(), "charlie", "vlm-lite", "0.001–0.0015"): (2, 2448, Decimal("0.002551")),
    }


def test_it_adds_up_to_the_images_and_cost_of_the_per_image_report(world, flagship):
    day = _day(2, 8)
    _request("a-1", world.alice, flagship, day, [(1224, False), (700, True)])
    _request("a-2", world.alice, world.vision, day + dt.timedelta(hours=3), [(300, False)] * 3)
    _request("b-1", world.bob, world.vision, day + dt.timedelta(hours=9), [(9000, False)])
    _request("a-failed", world.alice, flagship, day, [(4000, False)], status="error")
    _request("a-dropped", world.alice, flagship, day, [(4000, False)], status="aborted")  # before any engine
    _roll_up()

    report = list(per_image_rows(since=_day(2, 0), until=_day(1, 0), tenants=Tenant.objects.all()))
    rows = ImageCostHistogram.objects.filter(day=day.date())
    assert sum(r.images for r in rows) == len(report) == 6
    assert sum(r.cost for r in rows) == sum(line[IMAGE_COLUMNS.index("cost")] for line in report)
    assert sum(r.image_tokens for r in rows) == 1224 + 700 + 3 * 300 + 9000


def test_rolling_up_again_or_from_scratch_gives_the_same_histogram(world, flagship):
    _request("a-1", world.alice, flagship, _day(2, 8), [(1224, False), (1224, True)])
    _request("a-2", world.alice, world.vision, _day(1, 8), [(300, False)])
    assert _roll_up() == 2
    first = _histogram()
    assert len(first) == 3

    assert _roll_up(seconds_later=5) == 0
    assert _histogram() == first

    RollupState.objects.all().delete()  # the watermark lost: every day recomputed
    assert _roll_up(seconds_later=10) == 2
    assert _histogram() == first
    assert ImageCostHistogram.objects.count() == 3


def test_a_late_image_updates_its_own_day_only(world, flagship):
    _request("a-1", world.alice, flagship, _day(2, 8), [(1224, False)])
    _request("a-2", world.alice, flagship, _day(1, 8), [(1224, False)])
    _roll_up()
    two_days_ago = _histogram(day=_day(2, 0).date())

    # Recorded now, made yesterday: a stream that ended late.
    _request("late", world.alice, flagship, _day(1, 23), [(1224, False), (5000, False)])
    assert rollup_daily(now=timezone.now() + dt.timedelta(seconds=2)) == 1

    assert _histogram(day=_day(1, 0).date()) == {
        (_day(1, 0).date(), "alice", "vlm-flagship", "0.002–0.003"): (2, 2448, Decimal("0.004896")),
        (_day(1, 0).date(), "alice", "vlm-flagship", "0.01–0.015"): (1, 5000, Decimal("0.010000")),
    }
    assert _histogram(day=_day(2, 0).date()) == two_days_ago


def test_a_price_change_during_the_day_prices_each_image_at_the_rate_then(world, flagship):
    PriceRate.objects.create(plan=flagship.price_plan, effective_from=_day(1, 12), text_input_per_mtok=Decimal("1"),
                             image_per_mtok=Decimal("20"), output_per_mtok=Decimal("3"))
    _request("morning", world.alice, flagship, _day(1, 11, 59), [(1000, False)])
    _request("noon", world.alice, flagship, _day(1, 12), [(1000, False)])
    _roll_up()

    assert _histogram() == {
        (_day(1, 0).date(), "alice", "vlm-flagship", "0.002–0.003"): (1, 1000, Decimal("0.002000")),
        (_day(1, 0).date(), "alice", "vlm-flagship", "0.02–0.03"): (1, 1000, Decimal("0.020000")),
    }


def test_images_with_no_price_in_effect_are_counted_as_unpriced(world, flagship):
    before_any_price = PRICES_FROM - dt.timedelta(days=1)
    _request("early", world.alice, flagship, before_any_price, [(1224, False)])
    _roll_up()

    assert _histogram() == {(before_any_price.date(), "alice", "vlm-flagship", "unpriced"): (1, 1224, Decimal("0"))}


def test_buckets_are_logarithmic_and_read_as_ranges_of_money():
    edges = ImageCostHistogram.EDGES
    assert list(edges) == sorted(edges) and edges[0] == 0 and edges[-1] == 10
    assert all(ImageCostHistogram.bucket(edge) == edge for edge in edges)
    assert ImageCostHistogram.bucket(Decimal("0.001499")) == Decimal("0.001")
    assert ImageCostHistogram.label(ImageCostHistogram.bucket(Decimal("0.001367"))) == "0.001–0.0015"
    assert ImageCostHistogram.label(ImageCostHistogram.bucket(Decimal("0.000003"))) == "0.000001–0.00001"
    assert ImageCostHistogram.label(ImageCostHistogram.bucket(Decimal("0"))) == "0"
    assert ImageCostHistogram.label(ImageCostHistogram.bucket(Decimal("42"))) == "≥ 10"
    assert ImageCostHistogram.label(None) == "unpriced"
