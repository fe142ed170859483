from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.exports import IMAGE_COLUMNS, csv_lines, in_batches, per_image_rows
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from tests.images import image_bytes

pytestmark = pytest.mark.django_db


def _request(world, tenant, request_id, when, images, status="ok"):
    picture = normalise(image_bytes(1920, 1080), Policy())
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=None, tier_id=world.vision.pk, status=status,
        images=[(picture, tokens, cached) for tokens, cached in images], image_tokens=sum(t for t, _ in images),
        text_tokens=50, output_tokens=20, created_at=when))


def _rows(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def test_finance_gets_one_row_per_image_priced_like_the_bill(client, world):
    now = timezone.now()
    _request(world, world.alice, "req-1", now, [(1224, False), (1224, True)])
    _request(world, world.charlie, "req-2", now, [(300, False)])
    _request(world, world.alice, "req-failed", now, [(999, False)], status="error")
    client.force_login(world.finance)
    response = client.get("/exports/images.csv")
    assert response["Content-Type"] == "text/csv"
    rows = _rows(response)
    assert list(rows[0]) == IMAGE_COLUMNS
    assert [(r["tenant"], r["request_id"], r["image_tokens"], r["cached_image_tokens"]) for r in rows] == [
        ("alice", "req-1", "1224", "0"), ("alice", "req-1", "1224", "1224"), ("charlie", "req-2", "300", "0")]
    assert (rows[0]["source_width"], rows[0]["sent_width"]) == ("1920", "1335")
    # 0.30 per million image tokens, half off when cached, plus 0.001 per image (the factory plan)
    assert Decimal(rows[0]["cost"]) == Decimal("0.001367")
    assert Decimal(rows[1]["cost"]) == Decimal("0.001184")


def test_the_date_range_and_the_roles_are_respected(client, world):
    _request(world, world.alice, "old", timezone.now() - dt.timedelta(days=40), [(100, False)])
    client.force_login(world.operator)
    assert _rows(client.get("/exports/images.csv")) == []
    earlier = (timezone.now() - dt.timedelta(days=41)).date().isoformat()
    assert len(_rows(client.get("/exports/images.csv", {"from": earlier}))) == 1
    assert client.get("/exports/images.csv", {"from": "yesterday"}).status_code == 400
    client.force_login(world.alice_admin)
    assert client.get("/exports/images.csv").status_code == 403


def test_under_asgi_rows_are_served_in_batches_not_read_whole():
    lines = csv_lines(["n"], ([n] for n in range(2500)))

    @async_to_sync
    async def collect():
        return [chunk async for chunk in in_batches(lines, size=1000)]

    chunks = collect()
    assert len(chunks) == 3
    assert b"".join(chunks).decode().split("\r\n")[:3] == ["n", "0", "1"]


def test_rows_are_generated_lazily():
    rows = per_image_rows(since=timezone.now(), until=timezone.now(), tenants=[])
    assert iter(rows) is rows  # a generator: nothing is read until asked for


def test_an_image_partly_inside_the_cached_prefix_is_priced_for_its_share(client, world):
    # The engine reused 1,152 of a 1,224-token image's positions (whole KV blocks).
    _request(world, world.alice, "req-partial", timezone.now(), [(1224, 1152)])
    client.force_login(world.finance)
    (row,) = _rows(client.get("/exports/images.csv"))
    assert row["cached_image_tokens"] == "1152"
    # 0.30 per million image tokens, half off the cached 1,152, plus 0.001 per image
    assert Decimal(row["cost"]) == (Decimal("0.30") * (72 + Decimal(1152) / 2) / 10**6
                                        + Decimal("0.001")).quantize(Decimal("0.000001"))


def test_money_is_written_with_six_decimals_whatever_the_database_summed():
    from controlplane.metering.exports import csv_lines

    lines = b"".join(csv_lines(["cost"], iter([[Decimal("0.00136700000000000012")], [Decimal("2")]])))
    assert lines.decode().split() == ["cost", "0.001367", "2.000000"]


def test_the_per_image_report_says_how_each_request_was_routed(client, world):
    picture = normalise(image_bytes(1920, 1080), Policy())
    now = timezone.now()
    for request_id, fields in (("req-first", {"escalation": "low_confidence", "confidence": 0.42}),
                               ("req-second", {"cascade_of": "req-first"})):
        usage_record(record=UsageRecord(
            request_id=request_id, tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
            images=[(picture, 100, False)], image_tokens=100, text_tokens=5, output_tokens=5, created_at=now,
            routed_by="rule 1, default", **fields))
    client.force_login(world.finance)
    rows = _rows(client.get("/exports/images.csv"))
    assert [(r["request_id"], r["routed_by"], r["cascade_of"], r["escalation"], r["confidence"]) for r in rows] == [
        ("req-first", "rule 1, default", "", "low_confidence", "0.42"),
        ("req-second", "rule 1, default", "req-first", "", "")]
