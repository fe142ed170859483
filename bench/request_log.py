"""The request log over a large history: a page of it, filtered, at any depth.

    python -m bench.request_log              (--events N, default 10,000,000; --quick for 200,000)

Runs against its own PostgreSQL database (created, migrated and dropped, as bench.metering
does) holding a history generated in bulk SQL: events over 30 days, skewed across 20 tenants,
three tiers, 2% failed and 1% aborted, latencies of 0.2-3.2 s.

For each filter an operator uses, a page of 50 is read through the page's own selector
(`usage_log`): the newest page, and a deep one (its cursor 100,000 events down the filtered
list, or as deep as the list goes). Compared in the same run with the naive way to page,
Django's Paginator (a COUNT of the filtered events, then OFFSET). Each figure is the median
of 5 reads; the plan column is the index PostgreSQL walked for the keyset page (from
EXPLAIN), and whether it had to sort (it must not: the index gives the order).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time

from bench.metering import BenchDatabase, generate_events, seed

PAGE = 50
DEEP = 100_000
REPEATS = 5


def _median_ms(fn) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _plan(queryset) -> str:
    """The indexes a query walks, and whether it sorts."""
    plan = json.loads(queryset.explain(format="json"))[0]["Plan"]
    indexes, sorts = [], False

    def walk(node):
        nonlocal sorts
        if node.get("Index Name"):
            indexes.append(node["Index Name"])
        if "Sort" in node["Node Type"]:
            sorts = True
        for child in node.get("Plans", ()):
            walk(child)

    walk(plan)
    return (", ".join(dict.fromkeys(indexes)) or "no index (seq scan)") + (" + sort" if sorts else "")


def _filters(world, now) -> list[tuple[str, object]]:
    from controlplane.metering.models import UsageEvent
    from controlplane.metering.selectors import LogQuery

    busiest = world.tenants[0]  # the skew gives the first tenant the most traffic
    quiet = world.tenants[-1]
    some_request = UsageEvent.objects.filter(tenant_id=quiet).values_list("request_id", flat=True)[:1].get()
    week_ago = now - dt.timedelta(days=7)
    return [
        ("everything", LogQuery()),
        ("busiest tenant", LogQuery(tenant_ids=(busiest,))),
        ("quietest tenant", LogQuery(tenant_ids=(quiet,))),
        ("one key", LogQuery(tenant_ids=(busiest,), api_key_id=world.keys[0])),
        ("one tier", LogQuery(tier_id=world.tiers[1])),
        ("not ok", LogQuery(failed_only=True)),
        ("status error", LogQuery(statuses=("error",))),
        ("tenant, not ok", LogQuery(tenant_ids=(busiest,), failed_only=True)),
        ("tenant, latency >= 3 s", LogQuery(tenant_ids=(busiest,), latency_min_ms=3000)),
        ("a day a week ago", LogQuery(since=week_ago - dt.timedelta(days=1), until=week_ago)),
        ("request id", LogQuery(request_id=some_request)),
    ]


def bench(events: int) -> None:
    import django.db
    from django.core.paginator import Paginator
    from django.utils import timezone

    from controlplane.metering.selectors import LogCursor, usage_log, usage_log_events

    world = seed()
    now = timezone.now()
    started = time.perf_counter()
    generate_events(world, 0, events, start=now - dt.timedelta(days=30), end=now)
    print(f"history: {events:,} events generated in {time.perf_counter() - started:.0f} s\n")
    print(f"  {'filter':24} {'keyset first':>12} {'keyset deep':>11} {'depth':>8} {'naive first':>11} "
          f"{'naive deep':>10} {'deep x':>7}  plan (keyset deep)")
    for label, query in _filters(world, now):
        events_of = usage_log_events(query)
        # The cursor of a deep page: the event DEEP down the list (or its last page).
        depth = min(DEEP, max(events_of.count() - PAGE, 0))
        edge = events_of.values_list("created_at", "id")[depth:depth + 1].first() if depth else None
        cursor = LogCursor(*edge) if edge else None
        first_ms = _median_ms(lambda q=query: usage_log(q, limit=PAGE))
        deep_ms = _median_ms(lambda q=query, c=cursor: usage_log(q, after=c, limit=PAGE))
        paginator = Paginator(events_of, PAGE)
        page_number = depth // PAGE + 1
        naive_first = _median_ms(lambda p=paginator: list(Paginator(p.object_list, PAGE).page(1)))
        naive_deep = _median_ms(lambda p=paginator, n=page_number: list(Paginator(p.object_list, PAGE).page(n)))
        plan = _plan(usage_log_events(query, after=cursor)[:PAGE + 1])
        print(f"  {label:24} {first_ms:10.2f}ms {deep_ms:9.2f}ms {depth:8,} {naive_first:9.1f}ms "
              f"{naive_deep:8.1f}ms {naive_deep / deep_ms:6.0f}x  {plan}", flush=True)
    django.db.connections.close_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--quick", action="store_true", help="200,000 events")
    args = parser.parse_args()
    database = BenchDatabase("bench_request_log")
    database.start()
    try:
        bench(200_000 if args.quick else args.events)
    finally:
        database.stop()


if __name__ == "__main__":
    main()
