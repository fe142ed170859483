"""The metering pipeline at volume: ingest rate, rollup time, per-image export time and memory.

    python -m bench.metering                 (or: make bench; --quick for small sizes, --help)

Runs against its own PostgreSQL database (created, migrated and dropped by the bench) and
its own keys in Redis, both on 127.0.0.1 like the test suite. The world: 20 tenants with
three API keys each (a few events carry no key), two vision tiers and a text tier, on price
plans that changed prices ten days ago.
- ingest: usage records (about half of them with one to four images) are put on the Redis
  usage stream with the journal's finish, 32 at a time, as the gateway does; then `usage_ingest`
  is called until the stream is empty. Events/s for each step and both, compared in the same
  run with a naive path: one `usage_record` call per event, each its own transaction, no
  stream. Two consumers, each its own process, then ingest one stream at once (each request
  stored once). Last, entries already stored are delivered again and ingested (stored once).
- rollup: for each history size (--rollup-sizes, default 1M and 10M) a history is generated
  in PostgreSQL with generate_series (not through the ORM): events spread over 30 days in time
  order, skewed across tenants, with their image rows (about one per event). The hourly and
  daily rollups (the daily one also rewrites each day's cost-per-image histogram) run from an
  empty watermark (full); then new events arrive, made within the last hour and recorded after
  the watermark, and both run again (incremental). An incremental run recomputes only the
  periods its new events touch: its cost follows the events of the current hour and day, not
  the length of the history.
- export: the per-image CSV of the newest --export-rows billed images (default 1M, on the
  first history) produced by per_image_rows + csv_lines and read to the end; compared with the
  same rows and lines collected into a list and one bytes object (what streaming alone
  saves), and with a naive export that evaluates a queryset of model instances into a list
  and writes the whole CSV into one string. Each runs in its own child process; "peak +MB" is
  the growth of the child's resident memory over its size before the export (VmHWM after
  resetting it through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.proc import descendants, parent, status_kb, tree_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
PG = "postgres://postgres@127.0.0.1:5432"
REDIS = "redis://127.0.0.1:6379/12"
TENANTS, KEYS_PER_TENANT = 20, 3


@dataclass
class World:
    tenants: list[int]
    keys: list[int]  # KEYS_PER_TENANT per tenant, in tenant order
    tiers: list[int]  # two vision tiers, then the text tier
    rates: list[tuple[int, int]]  # per tier, the rate of its plan before and after `change`
    change: object  # the moment every plan's price changed (a datetime)


class BenchDatabase:
    """A database and a Redis key prefix of the bench's own, gone when it ends."""

    def __init__(self, name: str):
        self.name = name
        self.prefix = f"bench-metering-{uuid.uuid4().hex[:8]}"

    def start(self) -> None:
        import psycopg

        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.name}"')
        env = {k: v for k, v in os.environ.items() if k not in ("USAGE_OUTBOX", "VAR_DIR")}
        env.update({"DATABASE_URL": f"{PG}/{self.name}", "REDIS_URL": REDIS, "CACHE_KEY_PREFIX": self.prefix,
                    "DEBUG": "false", "SECRET_KEY": "bench-" + "m" * 50, "LOG_LEVEL": "WARNING",
                    "DJANGO_SETTINGS_MODULE": "controlplane.settings"})
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        os.environ.clear()
        os.environ.update(env)  # inherited by the export's child processes
        import django

        django.setup()

    def stop(self) -> None:
        import psycopg
        import redis
        from django.db import connections

        connections.close_all()
        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(f"{self.prefix}:*"):
            client.delete(key)
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def seed() -> World:
    import datetime as dt
    from decimal import Decimal

    from django.utils import timezone

    from controlplane.catalog.models import ModelTier, PricePlan, PriceRate
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import api_key_create

    tiers, rates, now = [], [], timezone.now()
    change = now - dt.timedelta(days=10)
    for name, kind, family in (("vlm-lite", "vision", "qwen2_5_vl"), ("vlm-pro", "vision", "qwen2_5_vl"),
                               ("text", "text", "qwen2")):
        plan = PricePlan.objects.create(name=name)
        rates.append(tuple(
            PriceRate.objects.create(plan=plan, effective_from=since, text_input_per_mtok=Decimal("0.20") * scale,
                                     image_per_mtok=Decimal("0.30") * scale, output_per_mtok=Decimal("0.60") * scale,
                                     per_image_fee=Decimal("0.001"), cached_image_discount=Decimal("0.5")).pk
            for since, scale in ((now - dt.timedelta(days=400), 1), (change, 2))))
        tiers.append(ModelTier.objects.create(name=name, kind=kind, family=family, model_id=name,
                                              engine_kind="external", price_plan=plan).pk)
    tenants, keys = [], []
    for n in range(TENANTS):
        tenant = Tenant.objects.create(name=f"tenant-{n:02d}")
        tenants.append(tenant.pk)
        keys += [api_key_create(tenant=tenant, name=f"key-{k}").api_key.pk for k in range(KEYS_PER_TENANT)]
    return World(tenants, keys, tiers, rates, change)


def _tables() -> dict[str, str]:
    from controlplane.metering.models import (
        DailyUsage,
        HourlyUsage,
        RollupState,
        UsageEvent,
        UsageImage,
    )

    return {"event": UsageEvent._meta.db_table, "image": UsageImage._meta.db_table,
            "daily": DailyUsage._meta.db_table, "hourly": HourlyUsage._meta.db_table,
            "state": RollupState._meta.db_table}


def _sql(statement: str, params=None) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def _timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# --- ingest --------------------------------------------------------------------------------


def usage_records(world: World, count: int, label: str) -> list:
    """Records as the gateway hands them over: half carry one to four images."""
    from django.utils import timezone

    from controlplane.metering.records import ImageLine, UsageRecord

    now, records = timezone.now(), []
    for i in range(count):
        tenant = (i * 7) % TENANTS
        vision = i % 10 < 7
        images = []
        if vision:
            for position in range((0, 0, 1, 1, 1, 2, 3, 4)[(i // 3) % 8]):
                line = ImageLine(source_format="JPEG", source_width=4000, source_height=3000, width=1148,
                                 height=868, fingerprint=f"{i:012x}{position:04x}")
                images.append((line, 1274, 1152 if position == 0 and i % 4 == 0 else 0))
        image_tokens = sum(tokens for _, tokens, _ in images)
        cached_image = sum(cached for _, _, cached in images)
        records.append(UsageRecord(
            request_id=f"{label}-{i}", tenant_id=world.tenants[tenant],
            api_key_id=world.keys[tenant * KEYS_PER_TENANT + i % KEYS_PER_TENANT],
            tier_id=world.tiers[i % 2 if vision else 2], images=images, image_tokens=image_tokens,
            text_tokens=40 + i % 700, output_tokens=20 + i % 300, cached_tokens=cached_image + (i % 3) * 16,
            cached_image_tokens=cached_image, status="error" if i % 50 == 0 else "ok",
            http_status=502 if i % 50 == 0 else 200, latency_ms=300 + i % 2000, instance_id=None,
            created_at=now - timezone.timedelta(milliseconds=count - i)))
    return records


async def _put_all(records: list, concurrency: int = 32) -> None:
    from controlplane.gateway import ledger

    for start in range(0, len(records), concurrency):
        await asyncio.gather(*(ledger.finish(r) for r in records[start:start + concurrency]))


def drain() -> int:
    """Ingest the usage stream until it is empty; the events stored."""
    from controlplane.metering.outbox import usage_ingest

    stored = 0
    while done := usage_ingest():
        stored += done
    return stored


INGEST_ROUNDS = 3  # this machine's speed moves by tens of per cent: the median of three rounds


def bench_ingest(world: World, count: int, naive_count: int) -> None:
    import statistics

    from controlplane.gateway.apps import current_process
    from controlplane.metering.models import UsageEvent, UsageImage
    from controlplane.metering.outbox import BATCH
    from controlplane.metering.services import usage_record, usage_rows, usage_rows_store

    # Each round: `count` events put on the stream and ingested; then the floor, the same kind
    # of rows read and priced beforehand and written by the same COPY in the same batches
    # (PostgreSQL's own work: eleven indexes and five foreign keys a row), on the table as big.
    put, ingest, floor, stored = [], [], [], 0
    cpu = {"ingest": [], "floor": []}  # (this process, PostgreSQL) CPU seconds a round
    postgres = _postmaster()
    for round_ in range(INGEST_ROUNDS):
        records = usage_records(world, count, f"stream{round_}")
        put.append(_timed(lambda records=records: asyncio.run(_put_all(records)))[0])
        seconds, done = _cpu_timed(drain, postgres, cpu["ingest"])
        ingest.append(seconds)
        stored += done
        priced = [usage_rows(batch) for batch in _batches(usage_records(world, count, f"floor{round_}"), BATCH)]
        floor.append(_cpu_timed(lambda priced=priced: [usage_rows_store(rows) for rows in priced], postgres,
                                cpu["floor"])[0])
    # Two consumers at once, each its own process (as two workers' ingest tasks), on one stream.
    both = usage_records(world, count, "pair")
    asyncio.run(_put_all(both))
    pair_s, pair_done = _consumers_at_once(2)
    pair_kept = UsageEvent.objects.filter(request_id__startswith="pair").count()
    images = UsageImage.objects.filter(event__request_id__startswith="stream").count()
    naive = usage_records(world, naive_count, "naive")
    naive_s, _ = _timed(lambda: [usage_record(record=r) for r in naive])
    redelivered = usage_records(world, min(count, 2000), "stream0")
    # Entries delivered again reach the stream from elsewhere (a consumer that died before it
    # acknowledged, another process's copy): this process's memory of what it finished is not
    # what stops them; storing by request id is.
    current_process().ledger_book.finished.clear()
    asyncio.run(_put_all(redelivered))
    again_s, again = _timed(drain)
    kept = UsageEvent.objects.filter(request_id__startswith="stream").count()
    total = count * INGEST_ROUNDS
    print(f"ingest: {INGEST_ROUNDS} rounds of {count:,} events, {images / total:.2f} image rows per event; "
          f"{kept:,} events stored of {total:,} after {len(redelivered):,} were delivered again")
    print(f"  {'path (median round; each round)':44} {'events':>8} {'seconds':>8} {'events/s':>9}")
    for label, seconds in (("journal finish -> stream (32 concurrent)", put),
                           ("usage_ingest, stream -> PostgreSQL", ingest),
                           ("floor: the COPY alone, rows priced before", floor)):
        rates = ", ".join(f"{count / s:,.0f}" for s in seconds)
        median = statistics.median(seconds)
        print(f"  {label:44} {count:8,} {median:8.2f} {count / median:9,.0f}   ({rates})")
    for label, n, seconds in (("two consumers at once (both, together)", count, pair_s),
                              ("naive: usage_record per event, no stream", naive_count, naive_s),
                              ("usage_ingest of redelivered entries", again, again_s)):
        print(f"  {label:44} {n:8,} {seconds:8.2f} {n / seconds:9,.0f}")
    mine, theirs = ([statistics.median(c[i] for c in cpu["ingest"]) * 1e6 / count for i in (0, 1)],
                    [statistics.median(c[i] for c in cpu["floor"]) * 1e6 / count for i in (0, 1)])
    print(f"  CPU an event (median round): the ingest {mine[0]:.1f} µs in this process (reading, pricing, "
          f"packing rows) and {mine[1]:.1f} µs in PostgreSQL; the floor {theirs[0]:.1f} and {theirs[1]:.1f}")
    _print_floor_without_checks(world, count)
    _print_floor_without_indexes(world, count)
    ingest_s, floor_s = statistics.median(ingest), statistics.median(floor)
    print(f"  ingest vs naive: {count / ingest_s / (naive_count / naive_s):.1f}x; "
          f"ingest vs its floor (PostgreSQL alone): {floor_s / ingest_s:.2f}x; stored {stored:,} of {total:,}; "
          f"two consumers at once took {' and '.join(f'{n:,}' for n in pair_done)} entries and stored "
          f"{pair_kept:,} events of {count:,}\n")


def _postmaster() -> int:
    """PostgreSQL's postmaster: the parent of this connection's backend."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return parent(cursor.fetchone()[0])


def _cpu_timed(fn, postgres: int, into: list) -> tuple[float, object]:
    """_timed, and the CPU seconds this process and PostgreSQL spent meanwhile (appended to `into`)."""
    before = set(descendants(postgres))
    mine, theirs = time.process_time(), tree_cpu_seconds(postgres)
    seconds, result = _timed(fn)
    mine = time.process_time() - mine
    # A backend the work opened and closed counts once the postmaster has reaped it.
    deadline = time.monotonic() + 5
    while set(descendants(postgres)) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    into.append((mine, tree_cpu_seconds(postgres) - theirs))
    return seconds, result


def _in_turn(world: World, count: int, label: str, first, second) -> tuple[float, float]:
    """Seconds `2 * count` fresh events took written by `first(rows)` and by `second(rows)`,
    batch by batch in turn (this machine's speed drifts between minutes)."""
    from controlplane.metering.outbox import BATCH
    from controlplane.metering.services import usage_rows

    seconds = [0.0, 0.0]
    for n, batch in enumerate(_batches(usage_records(world, 2 * count, label), min(BATCH, count // 2))):
        rows = usage_rows(batch)
        seconds[n % 2] += _timed(lambda rows=rows, write=(first, second)[n % 2]: write(rows))[0]
    return seconds[0], seconds[1]


def _print_in_turn(count: int, first: tuple[str, float], second: tuple[str, float], what: str) -> None:
    for (label, seconds), note in ((first, ""), (second, f"   ({what})")):
        print(f"  {label:44} {count:8,} {seconds:8.2f} {count / seconds:9,.0f}{note}")


def _print_floor_without_checks(world: World, count: int) -> None:
    """Where the floor's time goes: the same COPY with PostgreSQL's foreign-key triggers off
    (session_replication_role, a superuser's setting the bench's database allows), set against
    it with them on, each batch in turn. Only a measure: the product keeps every key checked,
    the second check of what reaches an invoice."""
    from django.db import connection

    from controlplane.metering.services import usage_rows_store

    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        if not cursor.fetchone()[0]:
            return

    def as_role(role: str):
        def write(rows):
            with connection.cursor() as cursor:
                cursor.execute(f"SET session_replication_role = {role}")
            usage_rows_store(rows)
        return write

    try:
        checked, unchecked = _in_turn(world, count, "unchecked", as_role("origin"), as_role("replica"))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET session_replication_role = origin")
    _print_in_turn(count, ("floor again, batches in turn: keys checked", checked),
                   ("           the same without the key checks", unchecked),
                   "what PostgreSQL's per-row foreign-key triggers cost")


def _print_floor_without_indexes(world: World, count: int) -> None:
    """And what the secondary indexes cost: batches in turn, every other one written in a
    transaction that drops the events' and images' indexes other than their keys and the
    request id's (DDL is transactional in PostgreSQL) and is rolled back, the other in one that
    keeps them and is rolled back as well. The foreign keys are checked at commit (Django makes
    them deferred), so neither of these checks them: this is the COPY and its indexes alone.
    Only a measure: each index serves a page or a check."""
    from django.db import connection, transaction

    from controlplane.metering.models import UsageEvent, UsageImage
    from controlplane.metering.services import usage_rows_store

    with connection.cursor() as cursor:
        cursor.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid IN (%s::regclass, "
                       "%s::regclass) AND NOT indisunique", [UsageEvent._meta.db_table, UsageImage._meta.db_table])
        secondary = [name for (name,) in cursor.fetchall()]

    def rolled_back(dropping: list[str]):
        def write(rows):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    for name in dropping:
                        cursor.execute(f"DROP INDEX {name}")
                usage_rows_store(rows)
                transaction.set_rollback(True)
        return write

    kept, dropped = _in_turn(world, count, "unindexed", rolled_back([]), rolled_back(secondary))
    _print_in_turn(count, ("floor rolled back (no key checks), in turn", kept),
                   (f"           without its {len(secondary)} secondary indexes", dropped),
                   "what maintaining them costs")


def _drain_child(ready, start, queue) -> None:
    import django

    django.setup()
    from django.db import connection

    from controlplane.metering.outbox import usage_ingest

    connection.ensure_connection()
    ready.put(os.getpid())
    start.wait()
    stored = 0
    while done := usage_ingest():
        stored += done
    queue.put((stored, time.perf_counter()))


def _consumers_at_once(consumers: int) -> tuple[float, list[int]]:
    """Seconds from the start of `consumers` ingesting processes, set going together once each
    is connected, to the end of the last; and how many entries each stored or confirmed."""
    from django.db import connections

    connections.close_all()
    context = multiprocessing.get_context("spawn")
    ready, start, queue = context.Queue(), context.Event(), context.Queue()
    children = [context.Process(target=_drain_child, args=(ready, start, queue)) for _ in range(consumers)]
    for child in children:
        child.start()
    for _ in children:  # each has imported Django and connected
        ready.get(timeout=120)
    started = time.perf_counter()
    start.set()
    results = [queue.get(timeout=600) for _ in children]
    for child in children:
        child.join()
    return max(ended for _, ended in results) - started, [stored for stored, _ in results]


def _batches(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


# --- rollup --------------------------------------------------------------------------------


def generate_events(world: World, first: int, count: int, *, start, end, recorded=None) -> None:
    """`count` events made between start and end, in time order, with their image rows, in bulk
    SQL; request ids from `first` on. A few tenants make most of the traffic; 30% are text;
    3 in 4 vision requests carry images (1.5 on average); 2% failed, 1% aborted."""
    from django.db import connection

    from controlplane.metering.partitions import month_start, partitions_ensure

    # The history's months partitioned, as beat would have made them as it went.
    months = (end.year - start.year) * 12 + end.month - start.month
    partitions_ensure(now=month_start(start), ahead=months)
    tables = _tables()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COALESCE(max(id), 0) FROM {tables['event']}")
        (after,) = cursor.fetchone()

    columns = ("request_id, created_at, recorded_at, tenant_id, api_key_id, tier_id, instance_id, status, "
               "http_status, stream, latency_ms, image_count, image_tokens, cached_tokens, cached_image_tokens, "
               "text_tokens, output_tokens, cost, cache_savings, rated, image_tokens_disagree, prompt_estimated, "
               "prepare_ms, queue_ms, ttft_ms, rate_id, error_code, error_message, error_param, error_stage, "
               "cascade_of, escalation, routed_by")
    with connection.cursor() as cursor:
        cursor.execute(f"""
            INSERT INTO {tables['event']} ({columns})
            SELECT 'gen-' || i, at, COALESCE(%(recorded)s::timestamptz, at + interval '2 seconds'), tenant, key, tier, NULL,
                   status, CASE status WHEN 'error' THEN 502 ELSE 200 END, mod(i, 3) = 0, 200 + mod(i, 3000),
                   images, image_tokens, cached_image + (mod(i, 3)) * 16, cached_image, text_tokens, output_tokens,
                   CASE WHEN status = 'error' THEN 0 ELSE round(((text_tokens * 0.20 + (image_tokens
                       - cached_image * 0.5) * 0.30 + output_tokens * 0.60) / 1e6 + images * 0.001)::numeric, 6) END,
                   CASE WHEN status = 'error' THEN 0 ELSE round((cached_image * 0.5 * 0.30 / 1e6)::numeric, 6) END,
                   true, false, false, images * 12 + mod(i, 5), mod(i, 7),
                   CASE WHEN mod(i, 3) = 0 THEN 120 + mod(i, 400) END,
                   CASE WHEN status <> 'ok' THEN NULL WHEN at < %(change)s::timestamptz THEN (%(before)s::int[])[tier_at]
                        ELSE (%(after)s::int[])[tier_at] END,
                   CASE status WHEN 'error' THEN 'engine_error' ELSE '' END,
                   CASE status WHEN 'error' THEN 'the engine failed' ELSE '' END, '',
                   CASE status WHEN 'error' THEN 'engine' ELSE '' END, '', '', ''
            FROM (
                SELECT i, at, tenant, key, tier, tier_at, status, images, images * (256 + (mod(i, 5)) * 243) AS image_tokens,
                       CASE WHEN images > 0 AND mod(i, 4) = 0 THEN 256 + (mod(i, 5)) * 243 ELSE 0 END AS cached_image,
                       40 + mod(i, 700) AS text_tokens, 20 + mod(i, 300) AS output_tokens
                FROM (
                    SELECT i, at, (%(tenants)s::int[])[1 + t] AS tenant,
                           CASE WHEN mod(i, 20) = 0 THEN NULL ELSE (%(keys)s::int[])[1 + t * {KEYS_PER_TENANT}
                               + mod(i / 7, {KEYS_PER_TENANT})] END AS key,
                           (%(tiers)s::int[])[CASE WHEN mod(i, 10) < 5 THEN 1 WHEN mod(i, 10) < 7 THEN 2 ELSE 3 END] AS tier,
                           CASE WHEN mod(i, 10) < 5 THEN 1 WHEN mod(i, 10) < 7 THEN 2 ELSE 3 END AS tier_at,
                           CASE WHEN mod(i, 50) = 0 THEN 'error' WHEN mod(i, 97) = 0 THEN 'aborted' ELSE 'ok' END AS status,
                           CASE WHEN mod(i, 10) < 7 THEN (ARRAY[0, 0, 1, 1, 1, 2, 3, 4])[1 + mod(i / 3, 8)] ELSE 0 END
                               AS images
                    FROM (
                        SELECT i, %(start)s::timestamptz + (%(end)s::timestamptz - %(start)s::timestamptz)
                                   * ((i - %(first)s)::float8 / %(count)s) AS at,
                               floor({TENANTS} * power(mod(i * 0.6180339887, 1), 2))::int AS t
                        FROM generate_series(%(first)s::bigint, %(first)s::bigint + %(count)s - 1) AS i
                    ) AS spread
                ) AS chosen
            ) AS usage
        """, {"first": first, "count": count, "start": start, "end": end, "recorded": recorded,
              "tenants": world.tenants, "keys": world.keys, "tiers": world.tiers, "change": world.change,
              "before": [before for before, _ in world.rates], "after": [after for _, after in world.rates]})
        cursor.execute(f"""
            INSERT INTO {tables['image']} (event_id, created_at, position, source_format, source_width,
                                           source_height, width, height, tokens, fingerprint, cached, cached_tokens,
                                           tile, tiles)
            SELECT id, created_at, position, (ARRAY['JPEG', 'PNG', 'WEBP'])[1 + mod(id + position, 3)],
                   4000 - mod(id, 7) * 320, 3000 - mod(id, 5) * 240, 1148, 868, image_tokens / image_count,
                   left(md5(id || '-' || position), 16), position = 0 AND cached_image_tokens > 0,
                   CASE WHEN position = 0 THEN cached_image_tokens ELSE 0 END, 0, 1
            FROM {tables['event']}, generate_series(0, image_count - 1) AS position
            WHERE id > %s AND image_count > 0
        """, [after])
    connection.close()
    with connection.cursor() as cursor:
        for table in ("event", "image"):  # what autovacuum does after a bulk load
            cursor.execute(f"VACUUM ANALYZE {tables[table]}")


def _history_reset() -> None:
    from controlplane.metering.models import ImageCostHistogram

    tables = _tables()
    _sql(f"TRUNCATE {tables['image']}, {tables['event']}, {tables['daily']}, {tables['hourly']}, "
         f"{ImageCostHistogram._meta.db_table} RESTART IDENTITY")
    _sql(f"DELETE FROM {tables['state']}")


ROLLUP_HEADER = (f"  {'events':>11} {'generate s':>10} {'rollup':6} {'full s':>8} {'periods':>8} {'incr s':>8} "
                 f"{'periods':>8} {'full/incr':>9}")


def bench_rollup(world: World, size: int, new_events: int, days: int) -> None:
    """A history of `size` events in time order (stored as the gateway would have stored them),
    all rolled up, then new events, rolled up again."""
    import datetime as dt

    from django.utils import timezone

    from controlplane.metering.rollups import rollup_daily, rollup_hourly

    _history_reset()
    now = timezone.now()
    generate_s, _ = _timed(lambda: generate_events(world, 0, size, start=now - dt.timedelta(days=days), end=now))
    ran = now + dt.timedelta(seconds=5)
    full = {kind: _timed(lambda rollup=rollup: rollup(now=ran))
            for kind, rollup in (("hourly", rollup_hourly), ("daily", rollup_daily))}
    # New events: made within the last hour, recorded after the watermark.
    generate_events(world, size, new_events, start=ran - dt.timedelta(hours=1), end=ran,
                    recorded=ran + dt.timedelta(seconds=10))
    later = ran + dt.timedelta(minutes=1)
    for kind, rollup in (("hourly", rollup_hourly), ("daily", rollup_daily)):
        incr_s, incr_periods = _timed(lambda rollup=rollup: rollup(now=later))
        full_s, full_periods = full[kind]
        shown = f"{size:11,} {generate_s:10.1f}" if kind == "hourly" else " " * 22
        print(f"  {shown} {kind:6} {full_s:8.2f} {full_periods:8,} {incr_s:8.3f} {incr_periods:8,} "
              f"{full_s / incr_s:8.0f}x", flush=True)


# --- export --------------------------------------------------------------------------------


def export_window(rows: int):
    """From when the newest `rows` billed images were sent (a few more when they share a
    request), until tomorrow."""
    import datetime as dt

    from django.db import connection
    from django.utils import timezone

    tables = _tables()
    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT min(created_at) FROM (
                SELECT event.created_at FROM {tables['image']} AS image
                JOIN {tables['event']} AS event ON event.id = image.event_id
                WHERE event.status = 'ok' ORDER BY event.created_at DESC LIMIT %s) AS newest
        """, [rows])
        (since,) = cursor.fetchone()
    return since, timezone.now() + dt.timedelta(days=1)


def _streamed(since, until, tenants) -> tuple[int, int]:
    from controlplane.metering.exports import IMAGE_COLUMNS, csv_lines, per_image_rows

    lines = size = 0
    for line in csv_lines(IMAGE_COLUMNS, per_image_rows(since=since, until=until, tenants=tenants)):
        lines += 1
        size += len(line)
    return lines - 1, size


def _materialised(since, until, tenants) -> tuple[int, int]:
    """The same rows and lines, all held at once: what streaming alone saves."""
    from controlplane.metering.exports import IMAGE_COLUMNS, csv_lines, per_image_rows

    rows = list(per_image_rows(since=since, until=until, tenants=tenants))
    body = b"".join(csv_lines(IMAGE_COLUMNS, rows))
    return len(rows), len(body)


def _naive(since, until, tenants) -> tuple[int, int]:
    """The first version anyone writes: the queryset as a list (each image with its event and
    the rate that priced it), each image priced on its own, the CSV as one string. It writes
    the same rows as the export it is compared with."""
    import csv
    import io

    from controlplane.metering.exports import IMAGE_COLUMNS
    from controlplane.metering.models import UsageImage
    from controlplane.metering.rating import image_price, money_text
    from controlplane.metering.services import billed

    images = list(UsageImage.objects.filter(billed("event__"), event__created_at__gte=since,
                                            event__created_at__lt=until, event__tenant__in=tenants)
                  .select_related("event__tenant", "event__tier__price_plan", "event__rate")
                  .order_by("event__created_at", "event_id", "position"))
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(IMAGE_COLUMNS)
    for image in images:
        event = image.event
        cost = "" if event.rate is None else money_text(image_price(image.tokens, image.cached_tokens,
                                                                    event.rate.as_rates()))
        writer.writerow([event.tenant.name, event.request_id, event.created_at.isoformat(), event.tier.name,
                         image.source_width, image.source_height, image.width, image.height, image.tokens,
                         image.cached_tokens, cost, event.tier.price_plan.currency, event.routed_by,
                         event.cascade_of, event.escalation, "" if event.confidence is None else event.confidence])
    body = buffer.getvalue().encode()
    return len(images), len(body)


EXPORTS = {"per_image_rows + csv_lines": _streamed, "the same, held in memory": _materialised,
           "naive: models list, one string": _naive}


def _export_child(name: str, since: str, until: str, queue) -> None:
    import datetime as dt

    import django

    django.setup()
    from controlplane.tenants.models import Tenant

    fn = EXPORTS[name]
    since, until = dt.datetime.fromisoformat(since), dt.datetime.fromisoformat(until)
    tenants = Tenant.objects.all()
    fn(until, until, tenants)  # imports and a connection first
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    baseline = status_kb("VmRSS")
    started = time.perf_counter()
    rows, size = fn(since, until, tenants)
    elapsed = time.perf_counter() - started
    queue.put((rows, size, elapsed, (status_kb("VmHWM") - baseline) / 1024))


def bench_export(rows: int) -> None:
    from django.db import connections

    since, until = export_window(rows)
    connections.close_all()
    print(f"export: per-image CSV of the images sent since {since:%Y-%m-%d %H:%M}; each export in its own "
          f"child process")
    print(f"  {'export':30} {'rows':>10} {'MB':>7} {'seconds':>8} {'rows/s':>9} {'peak +MB':>9}")
    context = multiprocessing.get_context("spawn")
    for name in EXPORTS:
        queue = context.Queue()
        child = context.Process(target=_export_child, args=(name, since.isoformat(), until.isoformat(), queue))
        child.start()
        exported, size, seconds, peak = queue.get(timeout=3600)
        child.join()
        print(f"  {name:30} {exported:10,} {size / 1e6:7.1f} {seconds:8.2f} {exported / seconds:9,.0f} {peak:9.0f}",
              flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a try-out in a minute")
    parser.add_argument("--ingest-events", type=int, help="events through the stream (default 20,000)")
    parser.add_argument("--naive-events", type=int, help="events through usage_record one by one (default 5,000)")
    parser.add_argument("--rollup-sizes", help="comma-separated history sizes (default 1000000,10000000)")
    parser.add_argument("--new-events", type=int, default=10_000, help="events before the incremental rollup")
    parser.add_argument("--export-rows", type=int, help="image rows in the export (default 1,000,000)")
    parser.add_argument("--days", type=int, default=30, help="days the history spans")
    parser.add_argument("--parts", default="ingest,rollup,export", help="which parts to run (default all three)")
    parser.add_argument("--database", default="bench_metering", help="PostgreSQL database the bench creates and drops")
    args = parser.parse_args()
    small = args.quick
    ingest = args.ingest_events or (2_000 if small else 20_000)
    naive = args.naive_events or (500 if small else 5_000)
    sizes = sorted(int(s) for s in (args.rollup_sizes or ("20000,100000" if small else "1000000,10000000")).split(","))
    export_rows = args.export_rows or (20_000 if small else 1_000_000)

    parts = set(args.parts.split(","))
    database = BenchDatabase(args.database)
    database.start()
    try:
        world = seed()
        if "ingest" in parts:
            bench_ingest(world, ingest, naive)
        if "rollup" in parts:
            print(f"rollup: events over {args.days} days, {TENANTS} tenants x {KEYS_PER_TENANT} keys x 3 tiers, "
                  f"about one image per event; incremental after {args.new_events:,} new events made in the "
                  f"last hour")
            print(ROLLUP_HEADER, flush=True)
            for n, size in enumerate(sizes):
                bench_rollup(world, size, args.new_events, args.days)
                if n == 0 and "export" in parts:  # on the first history, before the next replaces it
                    print()
                    bench_export(export_rows)
                    if sizes[1:]:
                        print(ROLLUP_HEADER, flush=True)
        elif "export" in parts:
            from django.utils import timezone

            _history_reset()
            now = timezone.now()
            generate_events(world, 0, export_rows, start=now - timezone.timedelta(days=args.days), end=now)
            bench_export(export_rows)
    finally:
        database.stop()


if __name__ == "__main__":
    main()
