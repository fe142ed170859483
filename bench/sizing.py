"""What the usage history costs on disk, per event and per image, and a year of it at a rate.

    python -m bench.sizing [--events 1000000] [--rate 100] [--keep-months 3]

Generates `--events` events over 30 days with their image rows in its own PostgreSQL database
(bench.metering's history: 30 % text, 3 in 4 vision requests with pictures), rolls them up as
beat does, then measures each table as PostgreSQL stores it: heap, indexes and TOAST, per row.
Compared in the same run with the floor: the bytes of the rows' own values (pg_column_size of
each row), which any store must keep. From those it sizes a year at `--rate` requests a second,
and what stays on disk when events are kept `--keep-months` months (the rollups stay).
"""

from __future__ import annotations

import argparse
import datetime as dt

from bench.metering import BenchDatabase, _tables, generate_events, seed

DAY_S = 86_400


def _sizes(table: str) -> dict:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0),
                   pg_relation_size(%(t)s), pg_indexes_size(%(t)s), pg_total_relation_size(%(t)s)
            FROM {table} AS t""", {"t": table})
        rows, values, heap, indexes, total = cursor.fetchone()
    return {"rows": rows, "values": values, "heap": heap, "indexes": indexes, "total": total}


def _rollup() -> float:
    import time

    from controlplane.metering.rollups import rollup_daily, rollup_hourly

    started = time.perf_counter()
    rollup_hourly()
    rollup_daily()
    return time.perf_counter() - started


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=100.0, help="requests a second, for the year")
    parser.add_argument("--keep-months", type=int, default=3)
    args = parser.parse_args()
    database = BenchDatabase("bench_sizing")
    database.start()
    try:
        from django.utils import timezone

        world, now = seed(), timezone.now()
        generate_events(world, 1, args.events, start=now - dt.timedelta(days=30), end=now)
        rollup_s = _rollup()
        tables = _tables()
        measured = {name: _sizes(tables[name]) for name in ("event", "image", "hourly", "daily")}
    finally:
        database.stop()

    events = measured["event"]["rows"]
    print(f"{events:,} events over 30 days, {measured['image']['rows']:,} image rows; rolled up in {rollup_s:.1f} s")
    print(f"{'table':<8} {'rows':>12} {'values B/row':>13} {'heap B/row':>11} {'index B/row':>12} "
          f"{'total B/row':>12} {'of floor':>9}")
    for name, size in measured.items():
        rows = max(1, size["rows"])
        print(f"{name:<8} {size['rows']:>12,} {size['values'] / rows:>13.0f} {size['heap'] / rows:>11.0f} "
              f"{size['indexes'] / rows:>12.0f} {size['total'] / rows:>12.0f} "
              f"{size['total'] / max(1, size['values']):>8.1f}x")

    per_event = (measured["event"]["total"] + measured["image"]["total"]) / events
    floor = (measured["event"]["values"] + measured["image"]["values"]) / events
    images_per_event = measured["image"]["rows"] / events
    rollups_per_day = (measured["hourly"]["total"] + measured["daily"]["total"]) / 30
    daily = args.rate * DAY_S
    print(f"\nA year at {args.rate:g} requests a second: {daily:,.0f} events a day and "
          f"{daily * images_per_event:,.0f} image rows ({daily * (1 + images_per_event):,.0f} rows a day in all)")
    print(f"  per event with its images: {per_event:.0f} B on disk, {floor:.0f} B of values (the floor)")
    print(f"  a day: {_gb(daily * per_event)}; a month: {_gb(30 * daily * per_event)}; "
          f"a year: {_gb(365 * daily * per_event)} (at the floor: {_gb(365 * daily * floor)})")
    print(f"  kept {args.keep_months} months, then dropped a month at a time: "
          f"{_gb(args.keep_months * 30.4 * daily * per_event)} at most, plus rollups "
          f"({_gb(365 * rollups_per_day)} a year at this bench's 20 tenants and 3 tiers)")


if __name__ == "__main__":
    main()
