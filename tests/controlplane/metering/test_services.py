"""Usage recording and the daily rollup, against the real database."""

import datetime as dt
from collections import defaultdict
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.catalog.models import PriceRate
from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.models import DailyUsage, RollupState, UsageEvent, UsageImage
from controlplane.metering.ratebook import RateBook
from controlplane.metering.records import UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import usage_record
from controlplane.tenants.services import api_key_create
from tests.images import image_bytes

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]

NEW_PRICES_FROM = timezone.now().replace(microsecond=0) - dt.timedelta(days=5)


def _record(world, request_id, *, tenant=None, tier=None, created_at=None, text=0, image=0,
            cached=0, output=0, images=(), status="ok"):
    tenant = tenant or world.alice
    tier = tier or world.vision
    return usage_record(record=UsageRecord(
        request_id=request_id,
        tenant_id=tenant.pk,
        api_key_id=None,
        tier_id=tier.pk,
        images=list(images),
        image_tokens=image,
        text_tokens=text,
        output_tokens=output,
        cached_tokens=cached,
        cached_image_tokens=cached,  # these tests cache whole images only
        status=status,
        http_status=200 if status == "ok" else 502,
        created_at=created_at or timezone.now(),
    ))


def _new_prices(tier):
    return PriceRate.objects.create(
        plan=tier.price_plan, effective_from=NEW_PRICES_FROM,
        text_input_per_mtok=Decimal("1"), image_per_mtok=Decimal("2"),
        output_per_mtok=Decimal("3"), per_image_fee=Decimal("0.01"),
        cached_image_discount=Decimal("0"),
    )


# --- usage_record ------------------------------------------------------------------------


def test_usage_record_stores_one_event_with_its_images(world):
    wide = normalise(image_bytes(1920, 1080), Policy())
    small = normalise(image_bytes(320, 240, fmt="PNG", color=(1, 2, 3)), Policy())
    event = _record(world, "req-images", text=100, image=1224 + 102, cached=0, output=50,
                    images=[(wide, 1224), (small, 102)])

    stored = UsageEvent.objects.get(request_id="req-images")
    assert stored.pk == event.pk
    assert (stored.tenant_id, stored.tier_id) == (world.alice.pk, world.vision.pk)
    assert (stored.image_count, stored.image_tokens, stored.text_tokens, stored.output_tokens) == (
        2, 1326, 100, 50)
    rows = list(UsageImage.objects.filter(event=stored).order_by("position"))
    assert [(r.position, r.tokens) for r in rows] == [(0, 1224), (1, 102)]
    assert (rows[0].source_format, rows[0].source_width, rows[0].source_height) == ("JPEG", 1920, 1080)
    assert (rows[0].width, rows[0].height) == (wide.width, wide.height)
    assert rows[0].width * rows[0].height <= 1003520
    assert (rows[1].source_format, rows[1].width, rows[1].height) == ("PNG", 320, 240)
    assert rows[0].fingerprint == wide.fingerprint != rows[1].fingerprint


def test_usage_record_prices_with_the_rate_in_effect_when_the_request_was_made(world):
    _new_prices(world.vision)
    image = normalise(image_bytes(64, 64), Policy())
    usage = {"text": 100, "image": 2448, "cached": 1224, "output": 50,
             "images": [(image, 1224), (image, 1224)]}

    before = _record(world, "req-old-price", created_at=NEW_PRICES_FROM - dt.timedelta(days=1),
                     **usage)
    after = _record(world, "req-new-price", created_at=NEW_PRICES_FROM + dt.timedelta(hours=1),
                    **usage)

    # old card (0.20 / 0.30 / 0.60 per Mtok, 0.001 per image, cached images half price):
    # (100*0.20 + (2448 - 1224*0.5)*0.30 + 50*0.60) / 1e6 + 2*0.001 = 0.0026008 -> 0.002601
    assert UsageEvent.objects.get(pk=before.pk).cost == Decimal("0.002601")
    # new card (1 / 2 / 3 per Mtok, 0.01 per image, no cache discount):
    # (100*1 + 2448*2 + 50*3) / 1e6 + 2*0.01 = 0.025146
    assert UsageEvent.objects.get(pk=after.pk).cost == Decimal("0.025146")


def test_usage_record_caps_cached_tokens_at_image_tokens_for_pricing(world):
    # The engine's cached count includes text prefix hits; only image tokens are discounted.
    event = _record(world, "req-cached-text", text=1000, image=100, cached=900, output=0)
    # (1000*0.20 + (100 - 100*0.5)*0.30) / 1e6 = 0.000215
    assert UsageEvent.objects.get(pk=event.pk).cost == Decimal("0.000215")
    assert UsageEvent.objects.get(pk=event.pk).cached_tokens == 900


def test_failed_requests_are_recorded_but_cost_nothing(world):
    event = _record(world, "req-failed", text=500, output=0, status="error")
    stored = UsageEvent.objects.get(pk=event.pk)
    assert (stored.status, stored.http_status, stored.text_tokens) == ("error", 502, 500)
    assert stored.cost == Decimal("0")


def test_recording_the_same_request_twice_keeps_one_event(world):
    image = normalise(image_bytes(64, 64), Policy())
    first = _record(world, "req-twice", text=10, image=70, output=5, images=[(image, 70)])
    second = _record(world, "req-twice", text=999, image=0, output=999)

    assert second.pk == first.pk
    assert UsageEvent.objects.filter(request_id="req-twice").count() == 1
    stored = UsageEvent.objects.get(request_id="req-twice")
    assert (stored.text_tokens, stored.output_tokens, stored.image_count) == (10, 5, 1)
    assert UsageImage.objects.filter(event=stored).count() == 1


def test_a_batch_stores_what_one_by_one_stores_whatever_the_values(world):
    """The ingest's bulk path (COPY, each column sent as its type) keeps every value of an
    event and its images as the one-by-one path does: text with tabs, newlines and emoji,
    empty fields, another time zone to the microsecond, counts at their columns' limits, a
    tile of a long picture."""
    from controlplane.metering.records import ImageLine
    from controlplane.metering.services import usage_record_many

    key = api_key_create(tenant=world.bob, name="odd").api_key
    tile = ImageLine("PNG", 28, 9000, 28, 1400, "f" * 32, 3, 7)
    cases = [
        dict(text_tokens=2**31 - 1, output_tokens=10**9, created_at=dt.datetime(
            2026, 1, 1, 0, 0, 0, 1, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30)))),
        dict(api_key_id=key.pk, images=[(tile, 4, 4)], image_tokens=4, cached_tokens=4, cached_image_tokens=4,
             prepare_ms=0, ttft_ms=123_456, engine_image_tokens=0, image_tokens_disagree=True),
        dict(status="error", http_status=502, counted_prompt_tokens=2**31 - 1, prompt_estimated=False,
             stream=True, queue_ms=None),
    ]

    now = timezone.now()

    def records(prefix):
        return [UsageRecord(request_id=f"{prefix}\t{n}\\ é 😀\n", tenant_id=world.bob.pk, tier_id=world.vision.pk,
                            **{"api_key_id": None, "text_tokens": 17, "output_tokens": 3, "created_at": now, **case})
                for n, case in enumerate(cases)]

    for record in records("one"):
        usage_record(record=record)
    assert usage_record_many(records=records("many")) == len(cases)

    def stored(prefix):
        events = UsageEvent.objects.filter(request_id__startswith=prefix).order_by("request_id")
        return [({k: v for k, v in event.items() if k not in ("id", "recorded_at", "request_id")},
                 [{k: v for k, v in image.items() if k not in ("id", "event_id")}
                  for image in UsageImage.objects.filter(event_id=event["id"]).order_by("position").values()])
                for event in events.values()]

    one, many = stored("one"), stored("many")
    assert len(one) == len(cases) and many == one
    assert [e["request_id"][4:] for e in UsageEvent.objects.filter(request_id__startswith="many")
            .order_by("request_id").values("request_id")] == [f"\t{n}\\ é 😀\n" for n in range(len(cases))]
    assert one[0][0]["created_at"] == cases[0]["created_at"]


# --- rollup_daily ------------------------------------------------------------------------


def _day(days_ago, hour):
    today = timezone.now().astimezone(dt.UTC).date()
    return dt.datetime.combine(today - dt.timedelta(days=days_ago), dt.time(hour), tzinfo=dt.UTC)


def _expected_totals():
    """Per (day, tenant, tier), the sum of the stored events, added up in Python."""
    totals = defaultdict(lambda: defaultdict(int))
    for e in UsageEvent.objects.all():
        row = totals[(e.created_at.astimezone(dt.UTC).date(), e.tenant_id, e.tier_id)]
        row["requests"] += 1
        billed = e.status == "ok" or (e.status in ("aborted", "interrupted") and e.instance_id is not None)
        row["unbilled_requests"] += not billed
        if not billed:  # counted, and nothing more: it cost nothing
            continue
        for field, value in (("images", e.image_count), ("image_tokens", e.image_tokens),
                             ("cached_tokens", e.cached_tokens), ("cached_image_tokens", e.cached_image_tokens),
                             ("text_tokens", e.text_tokens), ("output_tokens", e.output_tokens),
                             ("cost", e.cost), ("cache_savings", e.cache_savings)):
            row[field] += value
    return {key: dict(values) for key, values in totals.items()}


def _rolled_up():
    return {
        (r.day, r.tenant_id, r.tier_id): {
            "requests": r.requests, "unbilled_requests": r.unbilled_requests, "images": r.images, "image_tokens": r.image_tokens,
            "cached_tokens": r.cached_tokens, "cached_image_tokens": r.cached_image_tokens,
            "text_tokens": r.text_tokens, "output_tokens": r.output_tokens, "cost": r.cost,
            "cache_savings": r.cache_savings,
        }
        for r in DailyUsage.objects.all()
    }


def _backdate_recording(seconds=600):
    """Make every stored event look recorded `seconds` ago (as a real run would see it)."""
    UsageEvent.objects.update(recorded_at=timezone.now() - dt.timedelta(seconds=seconds))


def _seed_usage(world):
    image = normalise(image_bytes(64, 64), Policy())
    specs = [
        # (tenant, tier, days ago, hour, text, image tokens, cached, output, images)
        (world.alice, world.vision, 2, 1, 100, 1224, 0, 40, 1),
        (world.alice, world.vision, 2, 23, 50, 2448, 1224, 10, 2),
        (world.alice, world.text, 2, 12, 800, 0, 0, 200, 0),
        (world.bob, world.vision, 2, 5, 30, 1224, 1224, 7, 1),
        (world.alice, world.vision, 1, 0, 10, 1224, 0, 1, 1),
        (world.bob, world.text, 1, 9, 123, 0, 0, 456, 0),
    ]
    for n, (tenant, tier, days_ago, hour, text, img, cached, out, count) in enumerate(specs):
        _record(world, f"seed-{n}", tenant=tenant, tier=tier, created_at=_day(days_ago, hour),
                text=text, image=img, cached=cached, output=out, images=[(image, 1224)] * count)
    # An engine error after the image was counted: in the totals as a failed request only.
    _record(world, "seed-failed", tenant=world.alice, tier=world.vision, created_at=_day(2, 3),
            text=70, image=1224, output=0, images=[(image, 1224)], status="error")


def test_rollup_totals_equal_the_sum_of_events_per_day_tenant_and_tier(world):
    _seed_usage(world)
    _backdate_recording()

    assert rollup_daily(now=timezone.now()) == 2  # two days touched

    rolled = _rolled_up()
    assert rolled == _expected_totals()
    assert len(rolled) == 5
    alice_vision_two_days_ago = rolled[(_day(2, 0).date(), world.alice.pk, world.vision.pk)]
    assert (alice_vision_two_days_ago["requests"], alice_vision_two_days_ago["unbilled_requests"]) == (3, 1)
    assert alice_vision_two_days_ago["image_tokens"] == 1224 + 2448
    assert alice_vision_two_days_ago["images"] == 3
    assert alice_vision_two_days_ago["text_tokens"] == 150


def test_rollup_twice_gives_the_same_totals(world):
    _seed_usage(world)
    _backdate_recording()
    rollup_daily(now=timezone.now())
    first = _rolled_up()

    assert rollup_daily(now=timezone.now() + dt.timedelta(seconds=5)) == 0
    assert _rolled_up() == first

    # Even a full recomputation from scratch (watermark lost) does not double count.
    RollupState.objects.all().delete()
    assert rollup_daily(now=timezone.now() + dt.timedelta(seconds=10)) == 2
    assert _rolled_up() == first
    assert DailyUsage.objects.count() == 5


def test_a_first_run_finds_every_hour_and_day_with_events_across_gaps_and_midnights(world):
    """A run from scratch finds its periods by stepping through the events' index from one
    period to the next: every day and hour with an event is rolled up, whatever lies between,
    including an event at the last microsecond of a day and one at the first of the next;
    an event recorded after the run's moment waits for the next run."""
    from controlplane.metering.models import HourlyUsage

    moments = [_day(9, 0), _day(9, 0) + dt.timedelta(minutes=59, seconds=59, microseconds=999_999),
               _day(8, 23) + dt.timedelta(minutes=59, seconds=59, microseconds=999_999), _day(7, 0),
               _day(3, 13), _day(3, 13) + dt.timedelta(minutes=30), _day(1, 5)]
    for n, at in enumerate(moments):
        _record(world, f"walk-{n}", text=10 + n, output=1, created_at=at)
    _backdate_recording()
    later = _record(world, "recorded-later", text=99, created_at=_day(5, 4))
    now = timezone.now()
    UsageEvent.objects.filter(pk=later.pk).update(recorded_at=now + dt.timedelta(minutes=1))

    assert rollup_daily(now=now) == 5
    days = {at.date() for at in moments}
    assert set(DailyUsage.objects.values_list("day", flat=True)) == days
    assert set(HourlyUsage.objects.values_list("hour", flat=True)) == {
        at.replace(minute=0, second=0, microsecond=0) for at in moments}
    assert sum(DailyUsage.objects.values_list("text_tokens", flat=True)) == sum(10 + n for n in range(7))

    assert rollup_daily(now=now + dt.timedelta(minutes=2)) == 1  # its own day, on the next run
    assert DailyUsage.objects.get(day=_day(5, 4).date()).text_tokens == 99
    assert _rolled_up() == _expected_totals()


def test_a_late_event_updates_its_own_day_on_the_next_run(world):
    _seed_usage(world)
    _backdate_recording()
    rollup_daily(now=timezone.now())
    yesterday, two_days_ago = _day(1, 0).date(), _day(2, 0).date()
    before_all = _rolled_up()
    before = before_all[(yesterday, world.alice.pk, world.vision.pk)]
    assert before["requests"] == 1

    # Recorded now, but the request was made yesterday (e.g. a stream that ended late).
    _record(world, "late", tenant=world.alice, tier=world.vision, created_at=_day(1, 22),
            text=7, image=1224, output=3,
            images=[(normalise(image_bytes(64, 64), Policy()), 1224)])

    assert rollup_daily(now=timezone.now() + dt.timedelta(seconds=2)) == 1  # only yesterday
    after = _rolled_up()
    assert after == _expected_totals()
    row = after[(yesterday, world.alice.pk, world.vision.pk)]
    assert row["requests"] == 2
    assert row["text_tokens"] == before["text_tokens"] + 7
    assert row["cost"] > before["cost"]
    # the other day is unchanged
    assert {k: v for k, v in after.items() if k[0] == two_days_ago} == {
        k: v for k, v in before_all.items() if k[0] == two_days_ago}


def test_the_watermark_means_a_run_without_new_events_rewrites_nothing(world):
    _seed_usage(world)
    _backdate_recording()
    assert rollup_daily(now=timezone.now()) == 2
    watermark = RollupState.objects.get(name="daily").watermark
    assert watermark is not None

    assert rollup_daily(now=timezone.now() + dt.timedelta(seconds=3)) == 0
    state = RollupState.objects.get(name="daily")
    assert state.watermark > watermark
    assert state.ran_at is not None


def test_events_recorded_within_the_last_second_wait_for_the_next_run(world):
    _record(world, "just-now", text=10, created_at=_day(0, 0))
    now = timezone.now()
    assert rollup_daily(now=now) == 0
    assert DailyUsage.objects.count() == 0
    assert rollup_daily(now=now + dt.timedelta(seconds=2)) == 1
    assert DailyUsage.objects.get().requests == 1


def test_an_event_that_commits_after_the_rollup_passed_its_stamp_is_still_counted(world):
    """A slow commit (or a gateway clock a little behind) stamps an event before the watermark."""
    now = timezone.now()
    rollup_daily(now=now)
    late = _record(world, "slow-commit", text=11, created_at=_day(0, 0))
    UsageEvent.objects.filter(pk=late.pk).update(recorded_at=now - dt.timedelta(seconds=30))
    assert rollup_daily(now=now + dt.timedelta(seconds=10)) == 1
    assert DailyUsage.objects.get(day=_day(0, 0).date()).text_tokens == 11


def test_only_images_inside_the_cached_prefix_are_priced_as_cached(world):
    """The engine reuses a prefix; text in it is not an image and earns no image discount."""
    image = normalise(image_bytes(64, 64), Policy())
    event = usage_record(record=UsageRecord(
        request_id="req-prefix", tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
        images=[(image, 1000, True), (image, 1000, False)], image_tokens=2000, text_tokens=500,
        output_tokens=10, cached_tokens=1400, cached_image_tokens=1000))
    rate = RateBook().rates_at(world.vision.price_plan_id, timezone.now())
    from controlplane.metering.rating import Usage, price

    assert event.cost == price(Usage(text_tokens=500, image_tokens=2000, cached_image_tokens=1000,
                                     output_tokens=10, images=2), rate)
    # The discount's worth is kept beside the cost: the price without it, minus the cost.
    stored = UsageEvent.objects.get(pk=event.pk)
    assert stored.cached_image_tokens == 1000
    assert stored.cache_savings == price(Usage(text_tokens=500, image_tokens=2000, output_tokens=10,
                                               images=2), rate) - stored.cost
    assert stored.cache_savings == Decimal("0.000150")  # 1000 tokens x 0.30/Mtok x 50% off
    assert [i.cached for i in event.images.order_by("position")] == [True, False]


def test_hourly_and_daily_totals_are_kept_per_key(world):
    from controlplane.metering.models import HourlyUsage
    from controlplane.metering.rollups import rollup_hourly
    from controlplane.tenants.models import ApiKey

    main, other = ApiKey.objects.get(name="alice-main"), api_key_create(tenant=world.alice, name="ci").api_key
    morning = _day(0, 9)
    for n, key in enumerate([main, main, other]):
        usage_record(record=UsageRecord(request_id=f"k{n}", tenant_id=world.alice.pk, api_key_id=key.pk,
                                        tier_id=world.vision.pk, image_tokens=100, created_at=morning))
    usage_record(record=UsageRecord(request_id="k-later", tenant_id=world.alice.pk, api_key_id=main.pk,
                                    tier_id=world.vision.pk, image_tokens=7, created_at=morning + dt.timedelta(hours=2)))
    _backdate_recording()
    assert rollup_hourly(now=timezone.now()) == 2  # two hours touched
    rollup_daily(now=timezone.now())
    hourly = {(h.hour.hour, h.api_key_id): h.image_tokens for h in HourlyUsage.objects.all()}
    assert hourly == {(9, main.pk): 200, (9, other.pk): 100, (11, main.pk): 7}
    daily = {d.api_key_id: (d.requests, d.image_tokens) for d in DailyUsage.objects.filter(tenant=world.alice)}
    assert daily == {main.pk: (3, 207), other.pk: (1, 100)}
    rollup_hourly(now=timezone.now() + dt.timedelta(minutes=10))  # again: idempotent
    assert {(h.hour.hour, h.api_key_id): h.image_tokens for h in HourlyUsage.objects.all()} == hourly
