"""Usage tables as they grow: the same work at 10 and at 30 million events.

    python -m bench.growth                   (--sizes 10000000,30000000; --quick for 1M and 3M)

A history made at a steady rate, as a year in production makes it: the first size spread over
the last three months up to now (so this month's partition and three before it), then the
history grown backwards at the same rate, month after month, to the next size (30M events:
nine months and ten partitions). At each size, on the same database, the work that runs every
day (each figure the median of its repeats):

- ingest: 3 rounds of 20,000 usage records through the Redis stream into PostgreSQL (as the
  gateway hands them over, half with pictures), each request looked for in every month first;
- the rollups: hourly and daily, run incrementally after that ingest (what beat runs each
  minute), and from scratch over the whole history (a rebuild, which grows with it by nature;
  shown per million events);
- request-log pages: for each filter an operator uses, the newest page of 50 and one 100,000
  events down (as bench.request_log; its Paginator comparison is left out here);
- statements: last month's for the busiest tenant, and the month's statements of every tenant;
- an export: the per-image CSV of the newest 1M pictures, streamed, in a child process.

Last, each figure at the largest size against the smallest, and whether it is within 1.5x.
Runs in its own PostgreSQL database (created, migrated and dropped, as bench.metering does).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing
import statistics

from bench.metering import (
    BenchDatabase,
    _export_child,
    _put_all,
    _timed,
    drain,
    export_window,
    generate_events,
    seed,
    usage_records,
)
from bench.request_log import DEEP, PAGE, _filters, _median_ms

MONTH = dt.timedelta(days=30)
INGEST, INGEST_ROUNDS = 20_000, 3
EXPORT_ROWS = 1_000_000
WITHIN = 1.5


def _months_of(size: int, first: int) -> dt.timedelta:
    """The span `size` events take at the rate of the first size (three months)."""
    return 3 * MONTH * (size / first)


def grow(world, have: int, size: int, first: int, now: dt.datetime) -> float:
    """The history from `have` events to `size`, made before the oldest ones, at the same rate.
    Returns the seconds it took."""
    end = now - _months_of(have, first)
    start = now - _months_of(size, first)
    return _timed(lambda: generate_events(world, have, size - have, start=start, end=end))[0]


def measure(world, size: int, days: float, now: dt.datetime) -> dict[str, float]:
    """Every figure at this size, in seconds."""
    figures: dict[str, float] = {}
    figures.update(_rollups_full(size, days))
    figures.update(_ingest(world, size))
    figures.update(_rollups_incremental())
    _forget_ingested(now)  # today as big at every size
    figures.update(_pages(world, now))
    figures.update(_statements(world, now))
    figures.update(_export())
    return figures


def _forget_ingested(now: dt.datetime) -> None:
    """The events the ingest stored (all made after the history), and their pictures."""
    from django.db import connection

    from controlplane.metering.models import UsageEvent, UsageImage

    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {UsageImage._meta.db_table} WHERE created_at > %s", [now])
        cursor.execute(f"DELETE FROM {UsageEvent._meta.db_table} WHERE created_at > %s", [now])


def _rollups_full(size: int, days: float) -> dict[str, float]:
    from controlplane.metering.models import (
        DailyUsage,
        HourlyUsage,
        ImageCostHistogram,
        RollupState,
    )
    from controlplane.metering.rollups import rollup_daily, rollup_hourly

    for model in (ImageCostHistogram, DailyUsage, HourlyUsage, RollupState):
        model.objects.all().delete()
    hourly, _ = _timed(rollup_hourly)
    daily, _ = _timed(rollup_daily)
    # A rebuild walks the history hour by hour: its time follows the hours, not the events.
    month = (hourly + daily) * 30 / days
    print(f"  rollups from scratch over {size:,} events, {days:.0f} days: hourly {hourly:.1f} s, daily {daily:.1f} s "
          f"({month:.1f} s a month of history)", flush=True)
    return {"rollups from scratch, s a month": month}


def _ingest(world, size: int) -> dict[str, float]:
    rounds, stored = [], 0
    for round_ in range(INGEST_ROUNDS):
        asyncio.run(_put_all(usage_records(world, INGEST, f"grown{size}-{round_}")))
        seconds, done = _timed(drain)
        rounds.append(seconds)
        stored += done
    median = statistics.median(rounds)
    print(f"  ingest: {INGEST_ROUNDS} rounds of {INGEST:,}, {stored:,} stored; "
          f"{', '.join(f'{INGEST / s:,.0f}' for s in rounds)} events/s (median {INGEST / median:,.0f})", flush=True)
    return {"ingest, s for 20,000 events": median}


def _rollups_incremental() -> dict[str, float]:
    from controlplane.metering.rollups import rollup_daily, rollup_hourly

    hourly, hours = _timed(rollup_hourly)
    daily, days = _timed(rollup_daily)
    print(f"  rollups after the ingest: hourly {hourly:.3f} s ({hours} hours), daily {daily:.3f} s ({days} days)",
          flush=True)
    return {"rollup hourly, incremental": hourly, "rollup daily, incremental": daily}


def _pages(world, now: dt.datetime) -> dict[str, float]:
    from controlplane.metering.selectors import LogCursor, usage_log, usage_log_events

    figures = {}
    print(f"  {'request-log filter':24} {'first page':>10} {'deep page':>10} {'depth':>8}", flush=True)
    for label, query in _filters(world, now):
        events_of = usage_log_events(query)
        depth = min(DEEP, max(events_of.count() - PAGE, 0))
        edge = events_of.values_list("created_at", "id")[depth:depth + 1].first() if depth else None
        cursor = LogCursor(*edge) if edge else None
        first = _median_ms(lambda q=query: usage_log(q, limit=PAGE)) / 1000
        deep = _median_ms(lambda q=query, c=cursor: usage_log(q, after=c, limit=PAGE)) / 1000
        print(f"  {label:24} {first * 1000:8.2f}ms {deep * 1000:8.2f}ms {depth:8,}", flush=True)
        figures[f"log page: {label}"] = first
        figures[f"log page deep: {label}"] = deep
    return figures


def _statements(world, now: dt.datetime) -> dict[str, float]:
    from controlplane.metering.statements import month_statements, statement
    from controlplane.tenants.models import Tenant

    last = (now.replace(day=1) - dt.timedelta(days=1)).date()
    busiest = Tenant.objects.get(pk=world.tenants[0])
    one = statistics.median(_timed(lambda: statement(tenant=busiest, year=last.year, month=last.month))[0]
                            for _ in range(3))
    every = statistics.median(_timed(lambda: month_statements(tenants=Tenant.objects.all(), year=last.year,
                                                              month=last.month))[0] for _ in range(3))
    print(f"  statements of {last:%Y-%m}: the busiest tenant's {one:.2f} s, every tenant's {every:.2f} s", flush=True)
    return {"statement, busiest tenant": one, "statements, every tenant": every}


def _export() -> dict[str, float]:
    from django.db import connections

    since, until = export_window(EXPORT_ROWS)
    connections.close_all()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_export_child,
                            args=("per_image_rows + csv_lines", since.isoformat(), until.isoformat(), queue))
    child.start()
    rows, size, seconds, peak = queue.get(timeout=3600)
    child.join()
    print(f"  export: {rows:,} pictures, {size / 1e6:.0f} MB of CSV in {seconds:.1f} s, peak +{peak:.0f} MB",
          flush=True)
    return {"export of 1M pictures": seconds}


def compare(sizes: list[int], figures: dict[int, dict[str, float]]) -> None:
    small, large = sizes[0], sizes[-1]
    print(f"\n{'':44} {small:>11,} {large:>11,} {'ratio':>6}")
    worst = 0.0
    for name, before in figures[small].items():
        after = figures[large][name]
        ratio = after / before
        unit = "" if "a month" in name else " s"
        worst = max(worst, ratio)
        print(f"  {name:42} {before:9.3f}{unit:2} {after:9.3f}{unit:2} {ratio:6.2f}x"
              f"{'' if ratio <= WITHIN else '  past ' + str(WITHIN) + 'x'}")
    print(f"\nworst ratio {worst:.2f}x ({'within' if worst <= WITHIN else 'past'} {WITHIN}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000000,30000000", help="history sizes, smallest first")
    parser.add_argument("--quick", action="store_true", help="1M and 3M events")
    parser.add_argument("--database", default="bench_growth")
    args = parser.parse_args()
    sizes = [1_000_000, 3_000_000] if args.quick else sorted(int(s) for s in args.sizes.split(","))
    database = BenchDatabase(args.database)
    database.start()
    try:
        from django.utils import timezone

        world = seed()
        now, have, figures = timezone.now(), 0, {}
        for size in sizes:
            seconds = grow(world, have, size, sizes[0], now)
            have = size
            print(f"history: {size:,} events over {_months_of(size, sizes[0]).days} days "
                  f"(generated in {seconds:.0f} s)", flush=True)
            figures[size] = measure(world, size, _months_of(size, sizes[0]).days, now)
        compare(sizes, figures)
    finally:
        database.stop()


if __name__ == "__main__":
    main()
