"""The usage lists of the metering API: per request, per hour, per day and per tier, with their
filters and pages, for tenants' keys and for staff."""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.utils import timezone
from drf_spectacular.drainage import GENERATOR_STATS

from controlplane.metering.models import UsageEvent
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily, rollup_hourly
from controlplane.metering.services import usage_record
from controlplane.tenants.services import api_key_create

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
FIGURES = ["requests", "unbilled_requests", "images", "image_tokens", "cached_tokens", "cached_image_tokens",
           "text_tokens", "output_tokens"]
MONEY = ["cost", "cache_savings"]
LISTS = ["/api/v1/usage/requests/", "/api/v1/usage/hourly/", "/api/v1/usage/daily/", "/api/v1/usage/by-tier/"]


def _record(world, tenant, request_id, *, at, tier=None, key=None, images=0, cached_images=0, status="ok"):
    """A request with `images` images of 500 tokens, of which `cached_images` came from the cache."""
    line = ImageLine(source_format="png", source_width=800, source_height=600, width=784, height=588,
                     fingerprint=request_id)
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=key.pk if key else None,
        tier_id=(tier or world.vision).pk, created_at=at, status=status,
        images=[(line, 500, n < cached_images) for n in range(images)],
        image_tokens=500 * images, cached_tokens=500 * cached_images, cached_image_tokens=500 * cached_images,
        text_tokens=40, output_tokens=12, instance_id=None))


def _rollup():
    later = timezone.now() + dt.timedelta(seconds=2)  # past the moment every event was recorded
    rollup_hourly(now=later)
    rollup_daily(now=later)


def _month(world):
    """Alice's requests over two days, two keys and two tiers; bob and charlie use the API too."""
    main = world.alice.api_keys.get()
    batch = api_key_create(tenant=world.alice, name="batch").api_key
    alice = [
        _record(world, world.alice, "a1", at=T0 + dt.timedelta(minutes=10), key=main, images=2),
        _record(world, world.alice, "a2", at=T0 + dt.timedelta(minutes=40), key=batch, images=1, cached_images=1),
        _record(world, world.alice, "a3", at=T0 + dt.timedelta(minutes=50), key=main, images=3, cached_images=2),
        _record(world, world.alice, "a4", at=T0 + dt.timedelta(hours=1, minutes=5), key=main, tier=world.text),
        _record(world, world.alice, "a5", at=T0 + dt.timedelta(days=1, hours=3), key=batch, images=4,
                cached_images=4),
        _record(world, world.alice, "a6", at=T0 + dt.timedelta(days=1, hours=3, minutes=20), key=batch,
                images=1, status="error"),
    ]
    _record(world, world.bob, "b1", at=T0 + dt.timedelta(minutes=10), key=world.bob.api_keys.get(), images=9)
    _record(world, world.bob, "b2", at=T0 + dt.timedelta(days=1), images=9, cached_images=9)
    _record(world, world.charlie, "c1", at=T0 + dt.timedelta(hours=5), images=7)
    _rollup()
    return alice, main, batch


def _walk(client, path, secret=None, /, **params):
    """Every row of a list, following its `next` links; with no API key, as the logged-in user."""
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"} if secret else {}
    response = client.get(path, params, **auth)
    rows = []
    while True:
        assert response.status_code == 200, response.content
        page = response.json()
        rows += page["results"]
        if page["next"] is None:
            assert len(rows) == page["count"]
            return rows
        response = client.get(page["next"], **auth)


def _sums(events, period) -> dict:
    """The totals the rollups should hold, summed here from the events themselves."""
    totals = defaultdict(Counter)
    for event in events:
        row = totals[period(event)]
        row["requests"] += 1
        billed = event.status == "ok" or (event.status in ("aborted", "interrupted") and event.instance_id is not None)
        row["unbilled_requests"] += not billed
        if not billed:  # counted apart, and nothing more: it cost nothing
            continue
        row["images"] += event.image_count
        for name in FIGURES[3:] + MONEY:
            row[name] += getattr(event, name)
    return {k: dict(v) for k, v in totals.items()}


def _figures(row) -> dict:
    return {**{name: row[name] for name in FIGURES}, **{name: Decimal(row[name]) for name in MONEY}}


def _key_prefix(event):
    return event.api_key.prefix if event.api_key else None


def _error(response, parameter) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == [parameter] and isinstance(body[parameter], list), body
    return " ".join(body[parameter])


# --- figures -------------------------------------------------------------------------------


def test_it_gives_hourly_totals_equal_to_the_events(client, world):
    alice, _, _ = _month(world)
    rows = _walk(client, "/api/v1/usage/hourly/", world.alice_key)
    got = {(dt.datetime.fromisoformat(r["hour"]), r["tier"], r["key_prefix"]): _figures(r) for r in rows}
    want = _sums(alice, lambda e: (e.created_at.replace(minute=0, second=0), e.tier.name, _key_prefix(e)))
    assert got == want
    assert len(rows) == 4  # hour 0 on two keys, hour 1 on the text tier, day two's hour 3
    assert [r["hour"] for r in rows] == sorted((r["hour"] for r in rows), reverse=True)


def test_it_gives_daily_totals_equal_to_the_events(client, world):
    alice, _, _ = _month(world)
    rows = _walk(client, "/api/v1/usage/daily/", world.alice_key)
    got = {(dt.date.fromisoformat(r["day"]), r["tier"], r["key_prefix"]): _figures(r) for r in rows}
    assert got == _sums(alice, lambda e: (e.created_at.date(), e.tier.name, _key_prefix(e)))
    assert {r["tenant"] for r in rows} == {"alice"}


def test_it_gives_totals_per_tier_equal_to_the_events(client, world):
    alice, _, _ = _month(world)
    rows = _walk(client, "/api/v1/usage/by-tier/", world.alice_key)
    assert [r["tier"] for r in rows] == ["text", "vlm-lite"]
    assert {r["tier"]: _figures(r) for r in rows} == _sums(alice, lambda e: e.tier.name)
    vision = rows[1]
    assert vision["cached_image_tokens"] == 500 * 7 and Decimal(vision["cache_savings"]) > 0


def test_each_request_shows_its_usage_and_what_the_cache_saved(client, world):
    alice, main, _ = _month(world)
    rows = {r["request_id"]: r for r in _walk(client, "/api/v1/usage/requests/", world.alice_key)}
    assert set(rows) == {e.request_id for e in alice}
    for event in alice:
        row = rows[event.request_id]
        assert row["cached_image_tokens"] == event.cached_image_tokens
        assert Decimal(row["cache_savings"]) == event.cache_savings
        assert row["tenant"] == "alice" and row["key_prefix"] == event.api_key.prefix
        assert row["currency"] == event.tier.price_plan.currency  # what its cost is in
    assert rows["a5"]["cached_image_tokens"] == 2000 and Decimal(rows["a5"]["cache_savings"]) > 0
    assert rows["a1"]["key_prefix"] == main.prefix and len(rows["a1"]["images"]) == 2


def test_a_cascades_two_attempts_say_how_they_were_routed_and_why_the_second_ran(client, world):
    label = "rule 1 (receipts), tenant alice, #7"
    for record in (UsageRecord(request_id="first", tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
                               text_tokens=40, output_tokens=3, routed_by=label, escalation="low_confidence",
                               confidence=0.42),
                   UsageRecord(request_id="second", tenant_id=world.alice.pk, api_key_id=None,
                               tier_id=world.vision.pk, text_tokens=40, output_tokens=5, routed_by=label,
                               cascade_of="first")):
        usage_record(record=record)
    rows = {r["request_id"]: r for r in _walk(client, "/api/v1/usage/requests/", world.alice_key)}
    first, second = rows["first"], rows["second"]
    assert (first["routed_by"], first["escalation"], first["confidence"], first["cascade_of"]) == (
        label, "low_confidence", 0.42, "")
    assert (second["cascade_of"], second["escalation"], second["confidence"]) == ("first", "", None)
    assert Decimal(first["cost"]) > 0 and Decimal(second["cost"]) > 0  # both billed


# --- filters -------------------------------------------------------------------------------


def _request_ids(client, secret, /, **params):
    return sorted(r["request_id"] for r in _walk(client, "/api/v1/usage/requests/", secret, **params))


def test_requests_filter_by_time_tier_key_and_status(client, world):
    _, main, batch = _month(world)
    key = world.alice_key
    assert _request_ids(client, key, since="2026-03-02") == ["a5", "a6"]
    assert _request_ids(client, key, until="2026-03-01") == ["a1", "a2", "a3", "a4"]  # the whole day
    assert _request_ids(client, key, since="2026-03-01T00:40:00Z", until="2026-03-01T01:05:00Z") == ["a2", "a3"]
    assert _request_ids(client, key, since="2026-03-01T01:45:00+01:00", until="2026-03-01T00:55") == ["a3"]
    assert _request_ids(client, key, tier="text") == ["a4"]
    assert _request_ids(client, key, key=batch.prefix) == ["a2", "a5", "a6"]
    assert _request_ids(client, key, key=f"vlm-{main.prefix}") == ["a1", "a3", "a4"]
    assert _request_ids(client, key, key=str(main.pk)) == ["a1", "a3", "a4"]
    assert _request_ids(client, key, status="error") == ["a6"]
    assert _request_ids(client, key, request_id="a3") == ["a3"]
    assert _request_ids(client, key, key=batch.prefix, status="ok", since="2026-03-02") == ["a5"]
    assert _request_ids(client, key, tier="vlm-lite", until="2026-02-28") == []


def test_rollup_lists_filter_by_range_tier_and_key(client, world):
    _, main, batch = _month(world)
    key = world.alice_key
    hours = _walk(client, "/api/v1/usage/hourly/", key, since="2026-03-01T01:00:00Z", until="2026-03-01")
    assert [(r["hour"], r["tier"]) for r in hours] == [("2026-03-01T01:00:00Z", "text")]
    assert {r["key_prefix"] for r in _walk(client, "/api/v1/usage/hourly/", key, key=batch.prefix)} == {batch.prefix}
    days = _walk(client, "/api/v1/usage/daily/", key, since="2026-03-02", until="2026-03-02")
    assert [(r["day"], r["requests"]) for r in days] == [("2026-03-02", 2)]
    assert [r["tier"] for r in _walk(client, "/api/v1/usage/daily/", key, tier="text")] == ["text"]
    by_tier = _walk(client, "/api/v1/usage/by-tier/", key, until="2026-03-01T01:00:00Z", key=main.prefix)
    assert [(r["tier"], r["requests"], r["images"]) for r in by_tier] == [("vlm-lite", 2, 5)]
    assert _walk(client, "/api/v1/usage/by-tier/", key, since="2026-03-03") == []


# --- pages ---------------------------------------------------------------------------------


def test_walking_the_pages_of_requests_shows_each_once_newest_first(client, world):
    moment = T0 + dt.timedelta(hours=2)  # all at the same instant: the order must still be total
    for n in range(23):
        _record(world, world.alice, f"r{n:02}", at=moment)
    _record(world, world.alice, "earlier", at=T0)
    _record(world, world.bob, "bobs", at=moment)
    rows = _walk(client, "/api/v1/usage/requests/", world.alice_key, limit=5)
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == 24
    assert ids[-1] == "earlier"
    expected = list(UsageEvent.objects.filter(tenant=world.alice).order_by("-created_at", "-id")
                    .values_list("request_id", flat=True))
    assert ids == expected


def test_walking_the_pages_of_hourly_rows_shows_each_once(client, world):
    keys = [world.alice.api_keys.get()] + [api_key_create(tenant=world.alice).api_key for _ in range(2)]
    for hour in range(3):
        for key in keys:
            for tier in (world.vision, world.text):
                _record(world, world.alice, f"h{hour}-{key.prefix}-{tier.name}", key=key, tier=tier,
                        at=T0 + dt.timedelta(hours=hour, minutes=7))
    _rollup()
    rows = _walk(client, "/api/v1/usage/hourly/", world.alice_key, limit=4)
    seen = [(r["hour"], r["tier"], r["key_prefix"]) for r in rows]
    assert len(seen) == len(set(seen)) == 18
    assert all(r["requests"] == 1 for r in rows)
    first = client.get("/api/v1/usage/hourly/", {"limit": 4, "offset": 16},
                       HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    assert first["count"] == 18 and len(first["results"]) == 2 and first["next"] is None


def test_a_page_is_at_most_a_thousand_rows(client, world):
    UsageEvent.objects.bulk_create(UsageEvent(request_id=f"bulk{n}", tenant=world.alice, tier=world.text,
                                              status="ok", created_at=T0) for n in range(1001))
    response = client.get("/api/v1/usage/requests/", {"limit": 5000}, HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    page = response.json()
    assert page["count"] == 1001 and len(page["results"]) == 1000
    assert "offset=1000" in page["next"]


# --- who sees what -------------------------------------------------------------------------


@pytest.mark.parametrize("path", LISTS)
def test_a_tenant_key_sees_only_its_own_rows_whatever_it_asks(client, world, path):
    _month(world)
    bob_key = world.bob.api_keys.get()
    mine = _walk(client, path, world.alice_key)
    assert mine and _walk(client, path, world.alice_key, tenant="alice") == mine
    if path != "/api/v1/usage/by-tier/":
        assert {r["tenant"] for r in mine} == {"alice"}
    auth = {"HTTP_AUTHORIZATION": f"Bearer {world.alice_key}"}
    for params, parameter in (({"tenant": "bob"}, "tenant"), ({"tenant": "nobody"}, "tenant"),
                              ({"key": bob_key.prefix}, "key"), ({"key": str(bob_key.pk)}, "key")):
        refused = client.get(path, params, **auth)
        assert "visible to you" in _error(refused, parameter)
        assert b"b1" not in refused.content and bob_key.prefix.encode() not in refused.content
    # the same words whether the tenant exists or not: a key learns nothing of others
    assert (client.get(path, {"tenant": "bob"}, **auth).json()["tenant"][0].replace("bob", "X")
            == client.get(path, {"tenant": "nobody"}, **auth).json()["tenant"][0].replace("nobody", "X"))


def test_a_tenant_key_cannot_reach_anothers_request_by_id(client, world):
    _month(world)
    assert _request_ids(client, world.alice_key, request_id="b1") == []
    assert _request_ids(client, world.bob_key, request_id="b1") == ["b1"]


def test_staff_filter_by_the_tenants_their_role_allows(client, world):
    _month(world)
    client.force_login(world.finance)
    tenants = {r["tenant"] for r in _walk(client, "/api/v1/usage/daily/")}
    assert tenants == {"alice", "bob", "charlie"}
    assert {r["tenant"] for r in _walk(client, "/api/v1/usage/hourly/", tenant="bob")} == {"bob"}
    assert _request_ids(client, None, tenant="bob") == ["b1", "b2"]
    bob_tiers = _walk(client, "/api/v1/usage/by-tier/", tenant="bob")
    assert [(r["tier"], r["requests"], r["images"]) for r in bob_tiers] == [("vlm-lite", 2, 18)]
    assert _request_ids(client, None, key=world.bob.api_keys.get().prefix) == ["b1"]

    client.force_login(world.charlie_admin)
    assert {r["tenant"] for r in _walk(client, "/api/v1/usage/hourly/")} == {"charlie"}
    assert "visible to you" in _error(client.get("/api/v1/usage/daily/", {"tenant": "alice"}), "tenant")


def test_the_usage_lists_want_a_key_or_a_login(client, world):
    for path in LISTS:
        assert client.get(path).status_code in (401, 403)
        assert client.get(path, HTTP_AUTHORIZATION="Bearer vlm-wrong").status_code == 401


# --- bad filters ---------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "params", "parameter", "words"), [
    ("/api/v1/usage/requests/", {"since": "yesterday"}, "since", "YYYY-MM-DD"),
    ("/api/v1/usage/requests/", {"until": "2026-13-01"}, "until", "YYYY-MM-DD"),
    ("/api/v1/usage/requests/", {"since": "2026-03-01T25:00:00"}, "since", "ISO 8601"),
    ("/api/v1/usage/requests/", {"since": "2026-03-01T12:00:00 01:00"}, "since", "%2B"),  # an unencoded +
    ("/api/v1/usage/requests/", {"since": "0001-01-01T00:00:00+05:00"}, "since", "out of range"),
    ("/api/v1/usage/requests/", {"since": "2026-03-02", "until": "2026-03-01"}, "until", "later than since"),
    ("/api/v1/usage/requests/", {"status": "done"}, "status", "ok, error, aborted, interrupted"),
    ("/api/v1/usage/requests/", {"tier": "gpt-5"}, "tier", "no tier named 'gpt-5'"),
    ("/api/v1/usage/requests/", {"key": "nope"}, "key", "visible to you"),
    ("/api/v1/usage/requests/", {"key": "9" * 40}, "key", "visible to you"),  # no id is that large
    ("/api/v1/usage/requests/", {"limit": "0"}, "limit", "from 1 to 1000"),
    ("/api/v1/usage/requests/", {"limit": "ten"}, "limit", "whole number"),
    ("/api/v1/usage/requests/", {"offset": "-5"}, "offset", "whole number"),
    ("/api/v1/usage/requests/", {"offset": "9" * 5000}, "offset", "whole number"),
    ("/api/v1/usage/daily/", {"since": "2026-03-01T00:00:00Z"}, "since", "whole UTC days"),
    ("/api/v1/usage/daily/", {"until": "2026-03-01T10:00"}, "until", "YYYY-MM-DD"),
    ("/api/v1/usage/hourly/", {"since": "2026-03-01T12:30:00Z"}, "since", "on the hour"),
    ("/api/v1/usage/hourly/", {"until": "2026-03-01T12:00:00+05:30"}, "until", "on the hour"),
    ("/api/v1/usage/by-tier/", {"since": "2026-03-01T12:00:01Z"}, "since", "on the hour"),
    ("/api/v1/usage/by-tier/", {"since": "2026-03-02", "until": "2026-03-01T00:00:00Z"}, "until", "later"),
])
def test_a_bad_filter_is_a_400_that_says_what_would_do(client, world, path, params, parameter, words):
    response = client.get(path, params, HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert words in _error(response, parameter)


def test_a_day_or_hour_range_that_is_fine_is_accepted(client, world):
    _month(world)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {world.alice_key}"}
    for path, params in (("/api/v1/usage/hourly/", {"since": "2026-03-01T05:00:00+05:00"}),
                         ("/api/v1/usage/daily/", {"since": "2026-03-01", "until": "9999-12-31"}),
                         ("/api/v1/usage/requests/", {"until": "9999-12-31", "tier": "", "key": ""})):
        response = client.get(path, params, **auth)
        assert response.status_code == 200, response.content
        assert response.json()["count"] > 0


# --- the schema ----------------------------------------------------------------------------


def test_the_schema_documents_every_usage_list_and_its_filters(client, world):
    paths = client.get("/api/schema/", {"format": "json"}).json()["paths"]
    common = {"since", "until", "tier", "key", "tenant", "limit", "offset"}
    for path in LISTS:
        parameters = {p["name"] for p in paths[path]["get"]["parameters"]}
        assert common <= parameters, path
    requests = {p["name"]: p for p in paths["/api/v1/usage/requests/"]["get"]["parameters"]}
    assert set(requests["status"]["schema"]["enum"]) == {"ok", "error", "aborted", "interrupted"}
    assert "request_id" in requests


def test_the_schema_is_generated_without_warnings(tmp_path):
    GENERATOR_STATS.reset()  # what earlier schema builds in this process warned about is not ours
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
    assert "/api/v1/usage/by-tier/" in (tmp_path / "schema.yaml").read_text()


# --- queries -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", LISTS)
def test_a_page_costs_the_same_queries_for_three_rows_as_for_thirty(client, world, path):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    keys = [world.alice.api_keys.get(), api_key_create(tenant=world.alice).api_key]

    def queries():
        with CaptureQueriesContext(connection) as captured:
            response = client.get(path, HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
        assert response.status_code == 200
        return len(captured), response.json()["count"]

    def record(first, last):
        for n in range(first, last):
            tier = world.vision if n < 3 else (world.vision, world.text)[n % 2]  # a second tier later
            _record(world, world.alice, f"q{n}", key=keys[n % 2], tier=tier, images=1,
                    at=T0 + dt.timedelta(hours=n))
        _rollup()

    record(0, 3)
    few, few_rows = queries()
    record(3, 30)
    many, many_rows = queries()
    assert many_rows > few_rows
    assert many == few
