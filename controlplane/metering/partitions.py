"""Usage events and their pictures, partitioned by month on PostgreSQL.

At 100 requests a second the two tables take 5.6 GB a day (docs/operators/production.md): a
month is 260 million events. Kept in one table, dropping a month is a DELETE of all of them
and a vacuum after; partitioned by the month they were made in, it is one DROP, and a query
over a period (a rollup, a statement, an export, a page of the request log) reads only the
months it spans. Each table has a partition per month, made ahead by beat
(`USAGE_PARTITION_MONTHS_AHEAD`), and a default one for rows outside them (history older than
the partitioning, a clock far off); a month's partition made after rows for it reached the
default takes them along.

A picture row carries its event's `created_at`, so that it lives in its event's month. An
event's primary key is (id, created_at) in the database, as PostgreSQL requires of a
partitioned table; ids still come from one sequence, so Django's `id` stays unique. A request
is stored once: a unique (request_id, created_at), every copy of a request's record carrying
the time it was made, and the ingest's look for ids already stored, over every month.
"""

from __future__ import annotations

import datetime as dt
import gzip
import logging
import re
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from controlplane.metering.models import RetiredMonth, RollupState, UsageEvent
from controlplane.metering.statements import month_sums

log = logging.getLogger(__name__)

TABLES = ("metering_usageevent", "metering_usageimage")
_MONTH = re.compile(r"_p([0-9]{4})([0-9]{2})$")
# What a month's events and its rollups must agree on before the events go.
_CHECKED = ("requests", "images", "image_tokens", "cached_image_tokens", "text_tokens", "output_tokens", "cost",
            "cache_savings")


def month_start(moment: dt.datetime) -> dt.datetime:
    moment = moment.astimezone(dt.UTC)
    return dt.datetime(moment.year, moment.month, 1, tzinfo=dt.UTC)


def next_month(start: dt.datetime) -> dt.datetime:
    return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)


def partition_name(table: str, start: dt.datetime) -> str:
    return f"{table}_p{start:%Y%m}"


def default_name(table: str) -> str:
    return f"{table}_default"


def partitioned(table: str) -> bool:
    """Whether `table` is partitioned here (PostgreSQL only; SQLite keeps one table)."""
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cur:
        cur.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)", [table])
        row = cur.fetchone()
    return bool(row and row[0])


def month_partition_create(cursor, table: str, start: dt.datetime) -> bool:
    """The partition of `table` for the month from `start`, unless it exists. Rows of that
    month already in the default partition are moved into it: detached from the default, a
    range PostgreSQL would otherwise refuse to carve out of it. Whether it was made."""
    name, end = partition_name(table, start), next_month(start)
    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
    if cursor.fetchone()[0]:
        return False
    default = default_name(table)
    cursor.execute(f'CREATE TABLE "{name}" (LIKE "{table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
    cursor.execute(f'WITH moved AS (DELETE FROM "{default}" WHERE created_at >= %s AND created_at < %s '
                   f'RETURNING *) INSERT INTO "{name}" SELECT * FROM moved', [start, end])
    if cursor.rowcount:
        log.warning("moved %s rows of %s from %s into its month's new partition", cursor.rowcount, name, default)
    cursor.execute(f'ALTER TABLE "{table}" ATTACH PARTITION "{name}" FOR VALUES FROM (%s) TO (%s)', [start, end])
    return True


def partitions_ensure(*, now: dt.datetime | None = None, ahead: int | None = None) -> list[str]:
    """This month's partitions and the next `ahead` months', made where missing."""
    if not all(partitioned(table) for table in TABLES):
        return []
    ahead = settings.USAGE_PARTITION_MONTHS_AHEAD if ahead is None else ahead
    made, start = [], month_start(now or timezone.now())
    for _ in range(ahead + 1):
        for table in TABLES:
            with transaction.atomic(), connection.cursor() as cursor:
                if month_partition_create(cursor, table, start):
                    made.append(partition_name(table, start))
        start = next_month(start)
    return made


def months_held(table: str = TABLES[0]) -> list[dt.datetime]:
    """The months `table` has a partition of, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                       "WHERE i.inhparent = %s::regclass", [table])
        names = [name for (name,) in cursor.fetchall()]
    return sorted(dt.datetime(int(m[1]), int(m[2]), 1, tzinfo=dt.UTC) for m in map(_MONTH.search, names) if m)


def partitions_retire(*, now: dt.datetime | None = None, keep_months: int | None = None,
                      archive_dir: str | None = None) -> list[str]:
    """Drop the months of events and pictures that ended `keep_months` whole months ago or more
    (USAGE_EVENTS_KEEP_MONTHS; 0 keeps every month), each only once checked: the rollups ran
    past its end, every event of it is priced, and its rollups equal its events for every
    tenant and model. Each is copied to `archive_dir` first, when one is set. A month that
    fails a check stays, and says why. Returns the months retired ("2026-09")."""
    keep = settings.USAGE_EVENTS_KEEP_MONTHS if keep_months is None else keep_months
    if keep <= 0 or not all(partitioned(table) for table in TABLES):
        return []
    archive = settings.USAGE_ARCHIVE_DIR if archive_dir is None else archive_dir
    cutoff = month_start(now or timezone.now())
    for _ in range(keep):
        cutoff = (cutoff - dt.timedelta(days=1)).replace(day=1)
    retired = []
    for start in months_held():
        end = next_month(start)
        if end > cutoff:
            break
        reason = _unready(start, end)
        if reason:
            log.error("usage of %s kept past its retention: %s", f"{start:%Y-%m}", reason)
            continue
        _retire(start, archive)
        retired.append(f"{start:%Y-%m}")
    return retired


def _unready(start: dt.datetime, end: dt.datetime) -> str:
    """Why the month's events may not go yet ("" when they may)."""
    daily = RollupState.objects.filter(name="daily").values_list("watermark", flat=True).first()
    if daily is None or daily < end:
        return "the daily rollup has not run past its end"
    unrated = UsageEvent.objects.filter(created_at__gte=start, created_at__lt=end, rated=False).count()
    if unrated:
        return f"{unrated} of its events are not priced"
    by = ("tenant_id", "tier_id")
    from_events, unbilled_events = month_sums(start=start, end=end, by=by, from_rollups=False)
    from_rollups, unbilled_rollups = month_sums(start=start, end=end, by=by, from_rollups=True)

    def keyed(rows):
        return {tuple(row[f] for f in by): tuple(row[f] or 0 for f in _CHECKED) for row in rows}

    events, rollups = keyed(from_events), keyed(from_rollups)
    differ = sorted(key for key in events.keys() | rollups.keys() if events.get(key) != rollups.get(key))
    differ += sorted(key for key in unbilled_events.keys() | unbilled_rollups.keys()
                     if unbilled_events.get(key, 0) != unbilled_rollups.get(key, 0))
    if differ:
        return (f"its rollups differ from its events for (tenant, model) {differ[:5]}: "
                f"{[(events.get(key), rollups.get(key)) for key in differ[:2]]}")
    return ""


def _retire(start: dt.datetime, archive: str) -> None:
    """The month's events and pictures copied (if `archive`), detached and dropped, in one
    transaction with the record of it."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no check of its rows left pending: it is dropped
        counts, copies = {}, []
        for table in TABLES:
            name = partition_name(table, start)
            cursor.execute(f'SELECT count(*) FROM "{name}"')
            counts[table] = cursor.fetchone()[0]
            if archive:
                copies.append(_archive(cursor, name, Path(archive)))
            cursor.execute(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"')
            cursor.execute(f'DROP TABLE "{name}"')
        RetiredMonth.objects.create(month=start.date(), events=counts[TABLES[0]], images=counts[TABLES[1]],
                                    archive=", ".join(copies))
    log.warning("retired the usage of %s: %s events and %s pictures dropped%s", f"{start:%Y-%m}",
                counts[TABLES[0]], counts[TABLES[1]], f", copied to {', '.join(copies)}" if copies else "")


def _archive(cursor, name: str, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.csv.gz"
    with gzip.open(path, "wb") as out, cursor.cursor.copy(f'COPY "{name}" TO STDOUT (FORMAT CSV, HEADER)') as copy:
        for data in copy:
            out.write(data)
    return str(path)


def table_partition(cursor, table: str, *, months_ahead: int) -> None:
    """Make `table` (with a `created_at` column) partitioned by month, its rows, indexes and
    constraints kept under their names, its primary key (id, created_at). A migration's step."""
    cursor.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                   "WHERE conrelid = %s::regclass AND contype <> 'p' ORDER BY conname", [table])
    constraints = cursor.fetchall()
    cursor.execute("SELECT indexdef FROM pg_indexes i WHERE tablename = %s AND NOT EXISTS ("
                   "SELECT 1 FROM pg_constraint c WHERE c.conindid = to_regclass(i.schemaname || '.' || i.indexname))",
                   [table])
    indexes = [indexdef for (indexdef,) in cursor.fetchall()]
    cursor.execute(f'SELECT min(created_at), max(id) FROM "{table}"')
    oldest, last_id = cursor.fetchone()
    new = f"{table}_partitioned"
    cursor.execute(f'CREATE TABLE "{new}" (LIKE "{table}" INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING STORAGE) '
                   "PARTITION BY RANGE (created_at)")
    cursor.execute(f'CREATE TABLE "{default_name(table)}" PARTITION OF "{new}" DEFAULT')
    start, until = month_start(oldest or timezone.now()), month_start(timezone.now())
    for _ in range(months_ahead):
        until = next_month(until)
    while start <= until:
        name = partition_name(table, start)
        cursor.execute(f'CREATE TABLE "{name}" PARTITION OF "{new}" FOR VALUES FROM (%s) TO (%s)',
                       [start, next_month(start)])
        start = next_month(start)
    cursor.execute(f'INSERT INTO "{new}" SELECT * FROM "{table}"')
    cursor.execute(f'DROP TABLE "{table}"')
    cursor.execute(f'ALTER TABLE "{new}" RENAME TO "{table}"')
    cursor.execute(f'ALTER SEQUENCE "{new}_id_seq" RENAME TO "{table}_id_seq"')
    if last_id:
        cursor.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)", [table, last_id])
    cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{table}_pkey" PRIMARY KEY (id, created_at)')
    for name, definition in constraints:
        cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}')
    for definition in indexes:
        cursor.execute(definition)
