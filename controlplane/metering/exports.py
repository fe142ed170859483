"""Finance exports: the per-image cost report and the per-tenant monthly summary, as CSV or
XLSX, streamed so memory stays flat at millions of rows.

Rows carry typed values (datetimes, ints, Decimal amounts of money, booleans, None for
unknown); each file format renders them its own way.
"""

from __future__ import annotations

import calendar
import csv
import datetime as dt
import io
import itertools
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal

import xlsxwriter
from asgiref.sync import sync_to_async
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncMonth
from django.http import StreamingHttpResponse

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import DailyUsage, UsageImage
from controlplane.metering.periods import month_bounds, month_of
from controlplane.metering.ratebook import RateBook
from controlplane.metering.rating import money_text
from controlplane.metering.services import billed
from controlplane.tenants.models import ApiKey

# How its request was routed: the rule that chose its tier; on a cascade's escalation, the
# request id of its first attempt; on a first attempt, why it was escalated and how sure it was.
ROUTING_COLUMNS = ["routed_by", "cascade_of", "escalation", "confidence"]
IMAGE_COLUMNS = ["tenant", "request_id", "time", "tier", "source_width", "source_height", "sent_width",
                 "sent_height", "image_tokens", "cached_image_tokens", "cost", "currency", *ROUTING_COLUMNS]
SUMMARY_COUNTERS = ("requests", "images", "image_tokens", "cached_image_tokens", "text_tokens", "output_tokens")
SUMMARY_AMOUNTS = ("cost", "cache_savings")
SUMMARY_COLUMNS = ["tenant", "month", "line", "tier", *SUMMARY_COUNTERS, *SUMMARY_AMOUNTS, "currency"]

IMAGES, MONTHLY_SUMMARY = "images", "monthly-summary"
SHEET_TITLES = {IMAGES: "Images", MONTHLY_SUMMARY: "Monthly summary"}
CSV, XLSX = "csv", "xlsx"
CONTENT_TYPES = {CSV: "text/csv", XLSX: "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"}
XLSX_MAX_ROWS = 1_048_576  # Excel's limit per sheet, header included: the rest continue on further sheets
FILE_CHUNK = 64 * 1024


class ExportError(ValueError):
    """A request for an export that cannot be answered as asked (the message says why)."""


# -- the per-image cost report ------------------------------------------------------------

def per_image_rows(*, since: dt.datetime, until: dt.datetime, tenants, tier=None, api_key=None) -> Iterator[list]:
    """One row per image sent to an engine: what it was, what it became, what it cost at the
    rate that priced its request (None when none did), in which currency, and how its request
    was routed. `tier` and `api_key`, when given, narrow them to that tier's or key's."""
    book = RateBook()
    # Bounded by the images' own created_at (their event's) too: only the period's months'
    # partitions of the images are read.
    images = (UsageImage.objects.filter(billed("event__"), event__created_at__gte=since, event__created_at__lt=until,
                                        created_at__gte=since, created_at__lt=until,
                                        event__tenant__in=tenants, **_narrowed("event__", tier, api_key))
              .order_by("event__created_at", "event_id", "position")
              .values_list("event__tenant__name", "event__request_id", "event__created_at", "event__tier__name",
                           "source_width", "source_height", "width", "height", "tokens", "cached_tokens",
                           "event__rate_id", "event__tier__price_plan__currency",
                           *(f"event__{name}" for name in ROUTING_COLUMNS)))
    for values in images.iterator(chunk_size=2000):
        row, (rate_id, currency), routing = values[:10], values[10:12], values[12:]
        price = book.image_price(rate_id, row[8], row[9])
        yield [*row, price, book.rate(rate_id).plan.currency if rate_id else currency, *routing]


# -- the per-tenant monthly summary ---------------------------------------------------------

def monthly_summary_rows(*, first: dt.date, last: dt.date, tenants, tier=None, api_key=None) -> Iterator[list]:
    """Per tenant and month from `first` to `last`: a line per tier, then the tenant's total in
    each currency its tiers bill in (amounts in two currencies are never added together); only
    `tier`'s line and only `api_key`'s requests when they are given.

    Read from the daily rollups. Costs and savings are sums of each request's recorded cost,
    so they equal the monthly statement's lines and totals to the micro-unit; like a statement,
    the counters leave failed requests out (the rollups count them apart).
    """
    sums = {name: Sum(name) for name in SUMMARY_COUNTERS + SUMMARY_AMOUNTS}
    sums["requests"] = Sum(F("requests") - F("unbilled_requests"))
    # Requests refused before their model was known bill nothing, and have no tier to be a line of.
    lines = (DailyUsage.objects.filter(tenant__in=tenants, day__gte=first, day__lte=last, tier__isnull=False,
                                       **_narrowed("", tier, api_key))
             .annotate(month=TruncMonth("day"))
             .values("tenant__name", "month", "tier__name", "tier__price_plan__currency")
             .annotate(**sums)
             .order_by("tenant__name", "month", "tier__name"))
    for (tenant, month), group in itertools.groupby(lines.iterator(), key=lambda r: (r["tenant__name"], r["month"])):
        period, totals = f"{month:%Y-%m}", {}
        for line in group:
            currency = line["tier__price_plan__currency"]
            values = [line[name] or 0 for name in SUMMARY_COUNTERS] + [
                line[name] or Decimal(0) for name in SUMMARY_AMOUNTS]
            total = totals.setdefault(currency, [0] * len(SUMMARY_COUNTERS) + [Decimal(0)] * len(SUMMARY_AMOUNTS))
            for index, value in enumerate(values):
                total[index] += value
            yield [tenant, period, "tier", line["tier__name"], *values, currency]
        for currency, total in sorted(totals.items()):
            yield [tenant, period, "total", None, *total, currency]


def _narrowed(path: str, tier, api_key) -> dict:
    """The lookups that keep one tier's and one key's rows (either may be None: every one)."""
    return {**({f"{path}tier": tier} if tier is not None else {}),
            **({f"{path}api_key": api_key} if api_key is not None else {})}


# -- what was asked for ---------------------------------------------------------------------

@dataclass(frozen=True)
class Period:
    """Whole days, `first` to `last` inclusive, in UTC."""

    first: dt.date
    last: dt.date

    @property
    def since(self) -> dt.datetime:
        return dt.datetime.combine(self.first, dt.time.min, tzinfo=dt.UTC)

    @property
    def until(self) -> dt.datetime:
        return dt.datetime.combine(self.last, dt.time.min, tzinfo=dt.UTC) + dt.timedelta(days=1)

    def whole_months(self) -> Period:
        """The calendar months this period touches, from the first day of the first to the
        last day of the last: what a monthly summary covers."""
        days_in_last = calendar.monthrange(self.last.year, self.last.month)[1]
        return Period(self.first.replace(day=1), self.last.replace(day=days_in_last))


def period_from(params: Mapping, *, today: dt.date) -> Period:
    """`month=YYYY-MM`, or `from`/`to` dates (YYYY-MM-DD; `from` defaults to the first of this
    month, `to` to today), or nothing: this month so far."""
    if month := params.get("month"):
        try:
            start, end = month_bounds(*month_of(month))
        except ValueError as exc:
            raise ExportError(f"month: {exc}") from None
        return Period(start.date(), end.date() - dt.timedelta(days=1))
    try:
        first = dt.date.fromisoformat(params.get("from") or today.replace(day=1).isoformat())
        last = dt.date.fromisoformat(params.get("to") or today.isoformat())
    except ValueError:
        raise ExportError("from and to must be dates: YYYY-MM-DD") from None
    if first > last:
        raise ExportError("from must not be after to")
    if last == dt.date.max:
        raise ExportError("to must be before 9999-12-31")
    return Period(first, last)


@dataclass(frozen=True)
class Export:
    report: str  # IMAGES or MONTHLY_SUMMARY
    filetype: str  # CSV or XLSX
    period: Period
    tenants: QuerySet  # of Tenant
    tenant_name: str = ""
    tier: ModelTier | None = None  # None: every tier
    api_key: ApiKey | None = None  # None: every key

    @property
    def filename(self) -> str:
        names = (self.tenant_name, self.tier and self.tier.name, self.api_key and self.api_key.prefix)
        who = "".join(f"{name}-" for name in names if name)
        if self.report == IMAGES:
            return f"image-costs-{who}{self.period.first}-{self.period.last}.{self.filetype}"
        first, last = (f"{day:%Y-%m}" for day in (self.period.first, self.period.last))
        return f"monthly-summary-{who}{first}{'' if first == last else '-' + last}.{self.filetype}"

    def columns(self) -> list[str]:
        return IMAGE_COLUMNS if self.report == IMAGES else SUMMARY_COLUMNS

    def rows(self) -> Iterator[list]:
        narrowed = {"tenants": self.tenants, "tier": self.tier, "api_key": self.api_key}
        if self.report == IMAGES:
            return per_image_rows(since=self.period.since, until=self.period.until, **narrowed)
        months = self.period.whole_months()
        return monthly_summary_rows(first=months.first, last=months.last, **narrowed)


def export_for(*, report: str, filetype: str, params: Mapping, tenants, today: dt.date) -> Export:
    """What an export request asks for, checked. `tenants` are those the caller may see; the
    optional `tenant` parameter narrows them to one by name, `tier` to one tier by name, `key`
    to one key by its prefix (and to its tenant). Every tenant leaves out the service's own
    traffic (internal tenants) unless `internal=1` or a key of theirs is asked for."""
    if report not in SHEET_TITLES or filetype not in CONTENT_TYPES:
        raise ExportError(f"no {report} report as {filetype}")
    period = period_from(params, today=today)
    name = _asked(params, "tenant")
    api_key = _key_asked(_asked(params, "key"), tenants)
    if name:
        tenants = tenants.filter(name=name)
        if not tenants.exists():
            raise ExportError(f"no tenant named {name!r}")
    elif api_key is None and params.get("internal") != "1":
        tenants = tenants.filter(internal=False)
    if api_key is not None:
        if name and api_key.tenant.name != name:
            raise ExportError(f"no key {api_key.prefix!r} of tenant {name!r}")
        tenants = tenants.filter(pk=api_key.tenant_id)
    return Export(report=report, filetype=filetype, period=period, tenants=tenants, tenant_name=name,
                  tier=_tier_asked(_asked(params, "tier")), api_key=api_key)


def _asked(params: Mapping, name: str) -> str:
    value = params.get(name) or ""
    if "\x00" in value:  # no name holds one, and the database refuses to compare with it
        raise ExportError(f"no {name} named {value!r}")
    return value


def _tier_asked(name: str) -> ModelTier | None:
    if not name:
        return None
    tier = ModelTier.objects.filter(name=name).first()
    if tier is None:
        raise ExportError(f"no tier named {name!r}")
    return tier


def _key_asked(prefix: str, tenants) -> ApiKey | None:
    """The key of that prefix, if it is one of `tenants`' (those the caller may see)."""
    if not prefix:
        return None
    api_key = ApiKey.objects.filter(prefix=prefix, tenant__in=tenants).select_related("tenant").first()
    if api_key is None:
        raise ExportError(f"no key {prefix!r} you can see")
    return api_key


def export_response(export: Export, *, asgi: bool) -> StreamingHttpResponse:
    """The file, streamed; under ASGI pulled in batches on one thread (see in_batches)."""
    if export.filetype == CSV:
        chunks, batch = csv_lines(export.columns(), export.rows()), 1000
    else:
        chunks, batch = xlsx_chunks(export.columns(), export.rows(), title=SHEET_TITLES[export.report]), 1
    response = StreamingHttpResponse(in_batches(chunks, size=batch) if asgi else chunks,
                                     content_type=CONTENT_TYPES[export.filetype])
    response["Content-Disposition"] = f'attachment; filename="{export.filename}"'
    return response


# -- CSV --------------------------------------------------------------------------------------

# A text cell a spreadsheet would read as a formula (or, after a tab or a return, as the start
# of one) is prefixed with an apostrophe, so that it stays text: names and answers in an export
# come from outside.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, str):
        return f"'{value}" if value.startswith(FORMULA_STARTS) else value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        # Money to the micro-unit, always six places: a sum read back from SQLite (a float
        # there) would otherwise print 14 to 18 digits.
        return money_text(value)
    return value


def csv_lines(header: list[str], rows: Iterator[list]) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    yield buffer.getvalue().encode()
    for row in rows:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow([_csv_cell(value) for value in row])
        yield buffer.getvalue().encode()


# -- XLSX -------------------------------------------------------------------------------------

def xlsx_file(header: list[str], rows: Iterator[list], *, title: str, rows_per_sheet: int = XLSX_MAX_ROWS):
    """The rows as a workbook in a rewound anonymous temporary file (closing it deletes it).

    Written in XlsxWriter's constant-memory mode: each row goes to disk as soon as the next
    begins. A sheet holds `rows_per_sheet` rows with its header; later rows continue on
    sheets named "<title> 2", "<title> 3", ... each with the header again.
    """
    out = tempfile.TemporaryFile(suffix=".xlsx")
    try:
        workbook = xlsxwriter.Workbook(out, {"constant_memory": True, "remove_timezone": True})
        bold = workbook.add_format({"bold": True})
        money = workbook.add_format({"num_format": "#,##0.000000"})  # its currency in a column
        when = workbook.add_format({"num_format": "yyyy-mm-dd hh:mm:ss"})

        def sheet_for(number: int):
            sheet = workbook.add_worksheet(title if number == 1 else f"{title} {number}")
            for col, name in enumerate(header):
                sheet.set_column(col, col, max(12, len(name) + 2))
                sheet.write_string(0, col, name, bold)
            sheet.freeze_panes(1, 0)
            return sheet

        number, at = 1, 1
        sheet = sheet_for(number)
        for row in rows:
            if at == rows_per_sheet:
                number, at = number + 1, 1
                sheet = sheet_for(number)
            for col, value in enumerate(row):
                if value is None:
                    continue
                if isinstance(value, bool):
                    sheet.write_boolean(at, col, value)
                elif isinstance(value, int | float):
                    sheet.write_number(at, col, value)
                elif isinstance(value, Decimal):
                    sheet.write_number(at, col, float(value), money)
                elif isinstance(value, dt.datetime):
                    sheet.write_datetime(at, col, value.astimezone(dt.UTC), when)
                else:
                    sheet.write_string(at, col, str(value))
            at += 1
        workbook.close()
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


def xlsx_chunks(header: list[str], rows: Iterator[list], *, title: str,
                rows_per_sheet: int = XLSX_MAX_ROWS) -> Iterator[bytes]:
    """The workbook, built when the first chunk is asked for, then read back in chunks."""
    with xlsx_file(header, rows, title=title, rows_per_sheet=rows_per_sheet) as handle:
        while chunk := handle.read(FILE_CHUNK):
            yield chunk


async def in_batches(lines: Iterator[bytes], size: int = 1000):
    """Serve a synchronous row generator under ASGI without reading it all into memory
    (Django would): batches are pulled on one thread, which also keeps the database cursor."""
    def take():
        return b"".join(itertools.islice(lines, size))

    while chunk := await sync_to_async(take)():
        yield chunk
