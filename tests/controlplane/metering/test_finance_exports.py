"""Finance exports: the per-tenant monthly summary and the per-image cost report, as CSV and
XLSX, from the dashboard and the API, for finance and operators only."""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
import tracemalloc
from decimal import Decimal

import openpyxl
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import connection
from django.test import AsyncClient
from django.utils import timezone

from controlplane.fleet.models import EngineInstance
from controlplane.metering.exports import (
    IMAGE_COLUMNS,
    SUMMARY_COLUMNS,
    monthly_summary_rows,
    xlsx_file,
)
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.metering.rating import MICRO
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily
from controlplane.metering.services import usage_record
from controlplane.metering.statements import statement
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.services import api_key_create
from tests.conftest import skip_without_postgresql

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]

XLSX_TYPE = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
PICTURE = ImageLine(source_format="jpeg", source_width=1920, source_height=1080, width=1335, height=751,
                    fingerprint="f" * 32)
MARCH = dt.datetime(2025, 3, 1, tzinfo=dt.UTC)


def _record(world, tenant, request_id, when, *, tier=None, images=(), text=50, output=20, status="ok",
            instance=None, api_key=None):
    """A request as the gateway records it; `images` are (tokens, served from cache) pairs."""
    cached = sum(tokens for tokens, hit in images if hit)
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=api_key.pk if api_key else None,
        tier_id=(tier or world.vision).pk,
        images=[(PICTURE, tokens, hit) for tokens, hit in images], image_tokens=sum(t for t, _ in images),
        cached_tokens=cached, cached_image_tokens=cached, text_tokens=text, output_tokens=output,
        status=status, instance_id=instance.pk if instance else None, created_at=when))


def _rollup():
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=5))


def _march(world):
    """March 2025 for alice and bob, with a request either side of the month; charlie is idle."""
    _record(world, world.alice, "a-1", MARCH + dt.timedelta(hours=9), images=[(1224, False), (1224, True)])
    _record(world, world.alice, "a-2", MARCH + dt.timedelta(days=14), images=[(300, False)])
    _record(world, world.alice, "a-text", MARCH + dt.timedelta(days=20), tier=world.text, text=1000, output=500)
    _record(world, world.alice, "a-failed", MARCH + dt.timedelta(days=30, hours=23), images=[(999, False)],
            status="error")
    _record(world, world.bob, "b-1", MARCH + dt.timedelta(days=2), images=[(1224, True)])
    _record(world, world.alice, "a-feb", MARCH - dt.timedelta(seconds=1), images=[(5000, False)])
    _record(world, world.alice, "a-apr", MARCH + dt.timedelta(days=31), images=[(7000, False)])
    _rollup()


def _summary(rows) -> dict:
    return {(row["tenant"], row["line"], row["tier"] or None): row for row in rows}


def _csv(response) -> list[dict]:
    assert response.status_code == 200, response.content
    assert response.streaming and not response.has_header("Content-Length")
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def _workbook(response):
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == XLSX_TYPE and response.streaming
    return openpyxl.load_workbook(io.BytesIO(b"".join(response.streaming_content)))


def _sheet_rows(sheet) -> list[dict]:
    header, *rows = sheet.iter_rows(values_only=True)
    return [dict(zip(header, row, strict=True)) for row in rows]


def _as_csv_text(value, money=False) -> str:
    """An XLSX cell as the CSV writes the same value (money always with six decimals)."""
    if value is None:
        return ""
    if money:
        return str(Decimal(repr(value)).quantize(MICRO))
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.UTC).isoformat()
    if isinstance(value, float):
        return str(Decimal(repr(value)).quantize(MICRO))
    return str(value)


def test_it_sums_each_tenant_month_per_tier_with_costs_equal_to_the_statement(world):
    _march(world)
    rows = [dict(zip(SUMMARY_COLUMNS, row, strict=True)) for row in
            monthly_summary_rows(first=MARCH.date(), last=dt.date(2025, 3, 31), tenants=Tenant.objects.all())]
    assert [(r["tenant"], r["line"], r["tier"]) for r in rows] == [
        ("alice", "tier", "text"), ("alice", "tier", "vlm-lite"), ("alice", "total", None),
        ("bob", "tier", "vlm-lite"), ("bob", "total", None)]
    assert {r["month"] for r in rows} == {"2025-03"}
    summary = _summary(rows)
    alice = summary[("alice", "tier", "vlm-lite")]
    # a-1 and a-2; the failed request is left out, as the statement leaves it out
    assert (alice["requests"], alice["images"], alice["image_tokens"], alice["cached_image_tokens"]) == (
        2, 3, 1224 * 2 + 300, 1224)
    # a-1: (50 x 0.20 + (2448 - 1224 x 0.5) x 0.30 + 20 x 0.60) / 1e6 + 2 x 0.001, rounded to 1e-6
    a1 = UsageEvent.objects.get(request_id="a-1")
    assert (a1.cost, a1.cache_savings) == (Decimal("0.002573"), Decimal("0.000183"))
    for tenant in (world.alice, world.bob):
        bill = statement(tenant=tenant, year=2025, month=3)
        for line in bill["lines"]:
            assert summary[(tenant.name, "tier", line["tier"])]["cost"] == line["cost"]
        for line in bill["lines"]:  # every column, not only the money
            for name in ("requests", "images", "image_tokens", "text_tokens", "output_tokens"):
                assert summary[(tenant.name, "tier", line["tier"])][name] == line[name]
        total = summary[(tenant.name, "total", None)]
        assert total["cost"] == bill["total"]
        events = UsageEvent.objects.filter(tenant=tenant, created_at__gte=MARCH, created_at__lt=dt.datetime(
            2025, 4, 1, tzinfo=dt.UTC))
        assert total["cost"] == sum(e.cost for e in events)
        assert total["cache_savings"] == sum(e.cache_savings for e in events)
        for name in ("requests", "images", "image_tokens", "text_tokens", "output_tokens"):
            assert total[name] == sum(summary[(tenant.name, "tier", tier)][name]
                                      for (who, kind, tier) in summary if who == tenant.name and kind == "tier")
    # 0.001389 at full price less 0.001206 with half the image tokens at a discount
    assert summary[("bob", "total", None)]["cache_savings"] == Decimal("0.000183")


def test_the_summary_as_csv_and_xlsx_agree_with_each_other_and_the_statement(client, world):
    _march(world)
    client.force_login(world.finance)
    as_csv = _csv(client.get("/api/v1/exports/monthly-summary.csv", {"month": "2025-03"}))
    book = _workbook(client.get("/api/v1/exports/monthly-summary.xlsx", {"month": "2025-03"}))
    assert book.sheetnames == ["Monthly summary"]
    as_xlsx = _sheet_rows(book["Monthly summary"])
    assert list(as_csv[0]) == SUMMARY_COLUMNS == list(as_xlsx[0])
    assert [{k: _as_csv_text(v, money=k in ("cost", "cache_savings")) for k, v in row.items()} for row in as_xlsx] == as_csv
    for row in _summary(as_xlsx).values():
        assert isinstance(row["requests"], int) and isinstance(row["cost"], float)
    money = next(book["Monthly summary"].iter_rows(min_row=2, max_row=2))[SUMMARY_COLUMNS.index("cost")]
    assert money.number_format == "#,##0.000000"
    bill = statement(tenant=world.alice, year=2025, month=3)
    assert Decimal(_summary(as_csv)[("alice", "total", None)]["cost"]) == bill["total"]
    assert Decimal(repr(_summary(as_xlsx)[("alice", "total", None)]["cost"])).quantize(MICRO) == bill["total"]


def test_a_range_of_days_selects_the_whole_months_it_touches(client, world):
    _march(world)
    client.force_login(world.operator)
    response = client.get("/exports/monthly-summary.csv", {"from": "2025-02-20", "to": "2025-04-02"})
    assert response["Content-Disposition"] == 'attachment; filename="monthly-summary-2025-02-2025-04.csv"'
    rows = _csv(response)
    assert [(r["month"], r["line"], r["image_tokens"]) for r in rows if r["tenant"] == "alice"] == [
        ("2025-02", "tier", "5000"), ("2025-02", "total", "5000"),
        ("2025-03", "tier", "0"), ("2025-03", "tier", str(1224 * 2 + 300)),  # not the failed request's 999
        ("2025-03", "total", str(1224 * 2 + 300)),
        ("2025-04", "tier", "7000"), ("2025-04", "total", "7000")]
    only_bob = _csv(client.get("/exports/monthly-summary.csv", {"month": "2025-03", "tenant": "bob"}))
    assert {r["tenant"] for r in only_bob} == {"bob"}


def test_a_report_of_one_tier_and_one_key_holds_only_their_requests(client, world):
    main, other = ApiKey.objects.get(tenant=world.alice), api_key_create(tenant=world.alice, name="other").api_key
    _record(world, world.alice, "main-vision", MARCH, images=[(1224, False)], api_key=main)
    _record(world, world.alice, "main-text", MARCH, tier=world.text, text=1000, api_key=main)
    _record(world, world.alice, "other-vision", MARCH, images=[(300, False)], api_key=other)
    _rollup()
    client.force_login(world.finance)
    asked = {"month": "2025-03", "tier": world.vision.name, "key": main.prefix}
    summary = _csv(client.get("/api/v1/exports/monthly-summary.csv", asked))
    assert [(r["tenant"], r["line"], r["tier"], r["requests"], r["image_tokens"]) for r in summary] == [
        ("alice", "tier", world.vision.name, "1", "1224"), ("alice", "total", "", "1", "1224")]
    response = client.get("/exports/images.csv", asked)
    assert response["Content-Disposition"] == (
        f'attachment; filename="image-costs-{world.vision.name}-{main.prefix}-2025-03-01-2025-03-31.csv"')
    assert [r["request_id"] for r in _csv(response)] == ["main-vision"]
    assert [r["request_id"] for r in _csv(client.get("/exports/images.csv", {"month": "2025-03",
                                                                             "key": other.prefix}))] == ["other-vision"]


def test_the_image_report_as_csv_and_xlsx_agree_with_numbers_and_datetimes(client, world):
    _march(world)
    client.force_login(world.finance)
    as_csv = _csv(client.get("/exports/images.csv", {"month": "2025-03"}))
    book = _workbook(client.get("/exports/images.xlsx", {"month": "2025-03"}))
    as_xlsx = _sheet_rows(book["Images"])
    assert [(r["request_id"], r["cached_image_tokens"] != "0") for r in as_csv] == [
        ("a-1", False), ("a-1", True), ("b-1", True), ("a-2", False)]
    assert [{k: _as_csv_text(v, money=k in ("cost", "cache_savings")) for k, v in row.items()} for row in as_xlsx] == as_csv
    first = as_xlsx[0]
    assert first["time"] == dt.datetime(2025, 3, 1, 9, 0)  # UTC
    assert (first["image_tokens"], first["sent_width"], first["cached_image_tokens"]) == (1224, 1335, 0)
    cost = next(book["Images"].iter_rows(min_row=2, max_row=2))[IMAGE_COLUMNS.index("cost")]
    assert cost.value == pytest.approx(0.001367) and cost.number_format == "#,##0.000000"


def test_images_never_sent_to_an_engine_are_left_out(client, world):
    instance = EngineInstance.objects.create(tier=world.vision)
    _record(world, world.alice, "left-early", MARCH, images=[(400, False)], status="aborted")
    _record(world, world.alice, "left-late", MARCH, images=[(500, False)], status="aborted", instance=instance)
    client.force_login(world.finance)
    rows = _csv(client.get("/exports/images.csv", {"month": "2025-03"}))
    assert [r["request_id"] for r in rows] == ["left-late"]


def test_past_the_sheet_limit_rows_continue_on_further_sheets():
    handle = xlsx_file(["n", "when"], ([n, MARCH] for n in range(7)), title="Images", rows_per_sheet=3)
    with handle:
        book = openpyxl.load_workbook(handle)
    assert book.sheetnames == ["Images", "Images 2", "Images 3", "Images 4"]
    sheets = [list(book[name].iter_rows(values_only=True)) for name in book.sheetnames]
    assert all(rows[0] == ("n", "when") for rows in sheets)
    assert [row[0] for rows in sheets for row in rows[1:]] == list(range(7))


@pytest.mark.parametrize("path", ["images.csv", "images.xlsx", "monthly-summary.csv", "monthly-summary.xlsx"])
def test_only_finance_and_operators_may_export(client, world, path):
    url = f"/api/v1/exports/{path}"
    for user in (world.finance, world.operator):
        client.force_login(user)
        assert client.get(url).status_code == 200
        assert client.get(f"/exports/{path}").status_code == 200
    client.force_login(world.alice_admin)
    assert client.get(url).status_code == 403
    assert client.get(f"/exports/{path}").status_code == 403
    client.logout()
    refused = client.get(url, {"tenant": "alice"}, HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert refused.status_code == 403
    assert "finance and operator" in refused.json()["detail"]
    assert client.get(url).status_code in (401, 403)
    assert client.get(f"/exports/{path}")["Location"].startswith("/login/")


def _prefix(tenant) -> str:
    return ApiKey.objects.get(tenant=tenant).prefix


def test_malformed_requests_are_refused_with_the_reason(client, world):
    client.force_login(world.finance)
    for params, reason in (({"month": "2025-13"}, "YYYY-MM"), ({"from": "2025-03-05", "to": "2025-03-01"}, "after"),
                           ({"tenant": "nobody"}, "no tenant"), ({"tier": "nothing"}, "no tier"),
                           ({"key": "nokey"}, "no key"), ({"tenant": "bob", "key": _prefix(world.alice)}, "no key")):
        api = client.get("/api/v1/exports/images.csv", params)
        assert api.status_code == 400 and reason in api.json()["detail"]
        page = client.get("/exports/monthly-summary.xlsx", params)
        assert page.status_code == 400 and reason in page.content.decode()
    assert client.get("/api/v1/exports/images.pdf").status_code == 404
    assert client.get("/exports/images.pdf").status_code == 404
    # the file type is in the path: a client asking for CSV by Accept header is not refused
    assert client.get("/api/v1/exports/images.csv", HTTP_ACCEPT="text/csv").status_code == 200


def test_the_exports_page_is_in_the_nav_and_its_links_and_form_download(client, world):
    _record(world, world.alice, "now-1", timezone.now(), images=[(1224, False)])
    _rollup()
    client.force_login(world.alice_admin)
    assert "/exports/" not in client.get("/").content.decode()
    assert client.get("/exports/").status_code == 403
    client.force_login(world.finance)
    assert 'href="/exports/"' in client.get("/").content.decode()
    page = client.get("/exports/")
    assert page.status_code == 200
    links = re.findall(r'class="download" href="([^"]+)"', page.content.decode())
    assert len(links) == 8  # two reports, two periods, two file types
    this_month = f"{timezone.now():%Y-%m}"
    for link in links:
        response = client.get(link.replace("&amp;", "&"))
        expected = "text/csv" if ".csv?" in link else XLSX_TYPE
        assert response.status_code == 200 and response["Content-Type"] == expected
        content = b"".join(response.streaming_content)
        if link.endswith(f"month={this_month}") and expected == "text/csv":
            assert b"alice" in content
    submitted = client.get("/exports/", {"report": "monthly-summary", "month": "2025-03", "tenant": "alice",
                                         "filetype": "xlsx"})
    assert submitted.status_code == 302
    assert submitted["Location"] == "/exports/monthly-summary.xlsx?month=2025-03&tenant=alice"
    refused = client.get("/exports/", {"report": "images", "start": "2025-03-05", "end": "2025-03-01",
                                       "filetype": "csv"})
    assert refused.status_code == 200 and "from must not be after to" in refused.content.decode()


def _many_images(world, count: int):
    when = timezone.now()
    events = UsageEvent.objects.bulk_create(
        UsageEvent(request_id=f"bulk-{n}", created_at=when, tenant=world.alice, tier=world.vision, status="ok",
                   image_count=1, image_tokens=300) for n in range(count))
    UsageImage.objects.bulk_create(
        UsageImage(event=event, created_at=event.created_at, position=0, source_format="jpeg", source_width=800, source_height=600, width=800,
                   height=600, tokens=300, fingerprint="b" * 32) for event in events)


def _open_cursors() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_cursors")
        return cursor.fetchone()[0]


def test_a_large_export_is_streamed_while_the_database_is_read_in_chunks(client, world):
    skip_without_postgresql()  # it watches PostgreSQL's server-side cursors
    _many_images(world, 5000)
    client.force_login(world.finance)
    response = client.get("/exports/images.csv")
    assert response.streaming and not response.has_header("Content-Length")
    chunks = iter(response.streaming_content)
    header, first = next(chunks), next(chunks)
    assert header.startswith(b"tenant,request_id") and first.startswith(b"alice,bulk-")
    # The first rows are out while the rest are still behind an open database cursor.
    assert _open_cursors() == 1
    assert 2 + sum(1 for _ in chunks) == 5001
    assert _open_cursors() == 0


def test_an_xlsx_is_written_in_constant_memory():
    def rows(count):
        return (["alice", f"req_{n:032x}", MARCH, "vlm-lite", 1920, 1080, 1335, 751, 1224, n % 2 == 0,
                 Decimal("0.001367")] for n in range(count))

    xlsx_file(IMAGE_COLUMNS, rows(10), title="Images").close()  # formats and imports, once
    tracemalloc.start()
    try:
        xlsx_file(IMAGE_COLUMNS, rows(6000), title="Images").close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Held in memory, 66,000 cells would take about 9 MiB; written as they come, well under 1.
    assert peak < 2 * 2**20


def test_under_asgi_an_xlsx_is_sent_in_chunks(world):
    _many_images(world, 3000)

    @async_to_sync
    async def download():
        client = AsyncClient()
        await client.aforce_login(world.operator)
        response = await client.get("/api/v1/exports/images.xlsx")
        return response, [chunk async for chunk in response.streaming_content]

    response, chunks = download()
    assert response.status_code == 200 and response["Content-Type"] == XLSX_TYPE
    assert response.is_async  # Django would otherwise read a synchronous stream whole before sending
    assert len(chunks) > 1
    book = openpyxl.load_workbook(io.BytesIO(b"".join(chunks)), read_only=True)
    assert sum(1 for _ in book["Images"].iter_rows()) == 3001


def test_the_exports_are_in_the_api_schema_which_generates_without_warnings(client, world, tmp_path):
    schema = client.get("/api/schema/").content.decode()
    assert "/api/v1/exports/images.{filetype}" in schema
    assert "/api/v1/exports/monthly-summary.{filetype}" in schema
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


def test_every_tenants_reports_leave_out_the_services_own_traffic_unless_asked(client, world):
    from controlplane.tenants.services import internal_tenant

    _march(world)
    internal = internal_tenant()
    _record(world, internal, "bench-1", MARCH + dt.timedelta(days=3), images=[(1224, False)])
    _rollup()
    client.force_login(world.finance)
    every = _summary(_csv(client.get("/api/v1/exports/monthly-summary.csv", {"month": "2025-03"})))
    assert {tenant for tenant, _, _ in every} == {"alice", "bob"}
    asked = _summary(_csv(client.get("/api/v1/exports/monthly-summary.csv", {"month": "2025-03", "internal": "1"})))
    assert (internal.name, "total", None) in asked
    alone = _summary(_csv(client.get("/api/v1/exports/monthly-summary.csv",
                                     {"month": "2025-03", "tenant": internal.name})))
    assert {tenant for tenant, _, _ in alone} == {internal.name}  # named, it is reported
    images = _csv(client.get("/api/v1/exports/images.csv", {"month": "2025-03"}))
    assert images and internal.name not in {row["tenant"] for row in images}
