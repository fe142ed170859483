"""The gateway's traffic over time, per tier: requests and tokens per second, error rate, and
end-to-end latency and time to first token at p50 and p95, in fixed buckets.

Read from the usage events (what every client saw, failures included), as one grouped query
on PostgreSQL (percentile_cont over date_bin buckets) and, in embedded mode, summarised in
Python (SQLite has no percentiles; its volumes are small). Both give the same figures."""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from dataclasses import dataclass

from django.db import connection

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
    only_tiers = "AND tier_id = ANY(%(tiers)s)" if tier_ids is not None else ""
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
    events = UsageEvent.objects.filter(created_at__gte=since, created_at__lt=until)
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
