"""The gateway's traffic over time, per tier: requests and tokens per second, error rate, and
end-to-end latency and time to first token at p50 and p95, in fixed buckets.

Read from the usage events (what every client saw, failures included; not the requests refused
before their model was known, which no tier served), as one grouped query
on PostgreSQL (percentile_cont over date_bin buckets) and, in embedded mode, summarised in
Python (SQLite has no percentiles; its volumes are small). Both give the same figures."""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from dataclasses import dataclass

from django.db import connection

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import UsageEvent, is_server_error


@dataclass(frozen=True)
class TrafficPoint:
    at: dt.datetime  # the bucket's start
    requests: int
    errors: int  # failures of the service (5xx: SERVER_ERROR), not refusals the client caused
    tokens: int  # prompt (text and image) and output tokens
    latency_p50: float | None  # ms
    latency_p95: float | None
    ttft_p50: float | None  # ms, streamed requests only
    ttft_p95: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def traffic_by_tier(*, since: dt.datetime, until: dt.datetime, bucket: dt.timedelta,
                    tier_ids: list[int] | None = None) -> dict[int, list[TrafficPoint]]:
    """Per tier id, a point for each bucket that had requests, oldest first."""
    if connection.vendor == "postgresql":
        return _on_postgresql(since, until, bucket, tier_ids)
    return traffic_in_python(since=since, until=until, bucket=bucket, tier_ids=tier_ids)


def _on_postgresql(since, until, bucket, tier_ids) -> dict[int, list[TrafficPoint]]:
    table = UsageEvent._meta.db_table
    only_tiers = "AND tier_id = ANY(%(tiers)s)" if tier_ids is not None else "AND tier_id IS NOT NULL"
    sql = f"""
        SELECT tier_id, date_bin(%(bucket)s, created_at, %(origin)s) AS at, count(*),
               count(*) FILTER (WHERE status = 'error' AND http_status >= 500),  -- SERVER_ERROR
               coalesce(sum(text_tokens + image_tokens + output_tokens), 0),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY latency_ms),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_ms),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY ttft_ms)
        FROM {table}
        WHERE created_at >= %(since)s AND created_at < %(until)s {only_tiers}
        GROUP BY tier_id, at ORDER BY tier_id, at
    """
    series: dict[int, list[TrafficPoint]] = defaultdict(list)
    with connection.cursor() as cursor:
        cursor.execute(sql, {"bucket": bucket, "origin": since, "since": since, "until": until,
                             "tiers": tier_ids})
        for tier_id, at, requests, errors, tokens, p50, p95, t50, t95 in cursor.fetchall():
            series[tier_id].append(TrafficPoint(at, requests, errors, int(tokens), p50, p95, t50, t95))
    return dict(series)


def traffic_in_python(*, since, until, bucket, tier_ids=None) -> dict[int, list[TrafficPoint]]:
    events = UsageEvent.objects.filter(created_at__gte=since, created_at__lt=until, tier__isnull=False)
    if tier_ids is not None:
        events = events.filter(tier_id__in=tier_ids)
    groups: dict[tuple[int, int], list] = defaultdict(list)
    for row in events.values_list("tier_id", "created_at", "status", "text_tokens", "image_tokens",
                                  "output_tokens", "latency_ms", "ttft_ms", "http_status").iterator():
        groups[(row[0], (row[1] - since) // bucket)].append(row)
    series: dict[int, list[TrafficPoint]] = defaultdict(list)
    for (tier_id, index), rows in sorted(groups.items()):
        latencies = sorted(r[6] for r in rows)
        ttfts = sorted(r[7] for r in rows if r[7] is not None)
        series[tier_id].append(TrafficPoint(
            since + index * bucket, len(rows), sum(1 for r in rows if is_server_error(r[2], r[8])),
            sum(r[3] + r[4] + r[5] for r in rows), _percentile(latencies, 0.5), _percentile(latencies, 0.95),
            _percentile(ttfts, 0.5), _percentile(ttfts, 0.95)))
    return dict(series)


def _percentile(ordered: list, fraction: float) -> float | None:
    """Linear interpolation between the closest ranks: what percentile_cont computes."""
    if not ordered:
        return None
    rank = fraction * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


# The classes of request whose latencies differ by design: an image's prefill is tens of times
# a text request's, a large image's several times an image's.
CLASSES = ("text", "image", "large")


@dataclass(frozen=True)
class ClassLatency:
    """One class of request's latencies over a window, on a tier or one of its engines (ms)."""

    requests: int
    first_token: tuple[float | None, float | None, float | None]  # p50, p95, p99
    latency: tuple[float | None, float | None, float | None]
    queue_p95: float | None


def latency_by_class(*, since: dt.datetime, until: dt.datetime, by: str = "tier",
                     tier_ids: list[int] | None = None) -> dict[tuple[int, str], ClassLatency]:
    """Per (tier id, or engine id with `by="engine"`, and class): its requests' time to first
    token (a streamed request's first token; a whole answer's arrival otherwise, which is when
    its client sees its first token), end-to-end latency and time queued, at p50, p95 and p99.
    A request is large when its image tokens pass its tier's large-image threshold (today's)."""
    if connection.vendor == "postgresql":
        return _classes_on_postgresql(since, until, by, tier_ids)
    return latency_by_class_in_python(since=since, until=until, by=by, tier_ids=tier_ids)


def _classes_on_postgresql(since, until, by, tier_ids) -> dict[tuple[int, str], ClassLatency]:
    owner = "e.instance_id" if by == "engine" else "e.tier_id"
    only = ("AND e.tier_id = ANY(%(tiers)s) " if tier_ids is not None else "") + \
        ("AND e.instance_id IS NOT NULL" if by == "engine" else "")
    sql = f"""
        SELECT {owner},
               CASE WHEN e.image_count = 0 THEN 'text'
                    WHEN e.image_tokens > t.large_image_threshold THEN 'large' ELSE 'image' END AS kind,
               count(*),
               percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY coalesce(e.ttft_ms, e.latency_ms)),
               percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY e.latency_ms),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY e.queue_ms)
        FROM {UsageEvent._meta.db_table} e JOIN {ModelTier._meta.db_table} t ON t.id = e.tier_id
        WHERE e.created_at >= %(since)s AND e.created_at < %(until)s {only}
        GROUP BY 1, 2
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, {"since": since, "until": until, "tiers": tier_ids})
        return {(row[0], row[1]): ClassLatency(requests=row[2], first_token=tuple(row[3]), latency=tuple(row[4]),
                                               queue_p95=row[5])
                for row in cursor.fetchall()}


def latency_by_class_in_python(*, since, until, by="tier", tier_ids=None) -> dict[tuple[int, str], ClassLatency]:
    # As the join with the tiers does on PostgreSQL: no event without a tier.
    events = UsageEvent.objects.filter(created_at__gte=since, created_at__lt=until, tier__isnull=False)
    if tier_ids is not None:
        events = events.filter(tier_id__in=tier_ids)
    if by == "engine":
        events = events.exclude(instance_id=None)
    key = "instance_id" if by == "engine" else "tier_id"
    groups: dict[tuple[int, str], list] = defaultdict(list)
    rows = events.values_list(key, "image_count", "image_tokens", "tier__large_image_threshold", "ttft_ms",
                              "latency_ms", "queue_ms")
    for owner, images, image_tokens, threshold, ttft, latency, queued in rows.iterator():
        kind = "text" if not images else "large" if image_tokens > threshold else "image"
        groups[(owner, kind)].append((latency if ttft is None else ttft, latency, queued))
    found = {}
    for group, values in groups.items():
        first = sorted(v[0] for v in values)
        whole = sorted(v[1] for v in values)
        queued = sorted(v[2] for v in values if v[2] is not None)
        found[group] = ClassLatency(
            requests=len(values), first_token=tuple(_percentile(first, f) for f in (0.5, 0.95, 0.99)),
            latency=tuple(_percentile(whole, f) for f in (0.5, 0.95, 0.99)), queue_p95=_percentile(queued, 0.95))
    return found
