"""Operations: how the service is doing right now, for the operator on call.

Per tier, what clients saw (from the usage events): latency and time to first token at p50
and p95, error rate, requests and tokens per second. Per engine, what the engines report
(their scrapes): queue depth, KV cache use, tokens per second, their own time to first token.
Per node, its engines and the GPU memory they hold."""

from __future__ import annotations

import datetime as dt
import functools

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.utils import timezone

from controlplane.catalog.charts import tier_colours
from controlplane.catalog.models import ModelTier
from controlplane.fleet.charts import operations_chart
from controlplane.fleet.models import EngineInstance
from controlplane.fleet.selectors import engine_series, node_summaries
from controlplane.metering.traffic import CLASSES, latency_by_class, traffic_by_tier
from controlplane.web.access import operators_only

# The windows an operator picks from, and the bucket each is drawn in (about 60 points).
WINDOWS = {"1h": (dt.timedelta(hours=1), dt.timedelta(minutes=1)),
           "6h": (dt.timedelta(hours=6), dt.timedelta(minutes=5)),
           "24h": (dt.timedelta(hours=24), dt.timedelta(minutes=20)),
           "7d": (dt.timedelta(days=7), dt.timedelta(hours=2))}
DEFAULT_WINDOW = "1h"


@login_required
def operations(request):
    operators_only(request)
    window = request.GET.get("window") if request.GET.get("window") in WINDOWS else DEFAULT_WINDOW
    tiers = list(ModelTier.objects.order_by("name"))
    chosen = next((t for t in tiers if t.name == request.GET.get("tier")), None)
    tier_ids = [chosen.pk] if chosen else None
    length, bucket = WINDOWS[window]
    until = timezone.now()
    # Buckets start on whole multiples of their length, so a reload draws the same buckets.
    since = dt.datetime.fromtimestamp((until - length).timestamp() // bucket.total_seconds()
                                      * bucket.total_seconds(), tz=dt.UTC)
    names = {t.pk: t.name for t in tiers}
    traffic = {names[tier_id]: points for tier_id, points in
               traffic_by_tier(since=since, until=until, bucket=bucket, tier_ids=tier_ids).items()}
    instances = {i.pk: i for i in EngineInstance.objects.select_related("tier", "node")}
    engines = {_engine_label(instances[pk]): points for pk, points in
               engine_series(since=since, until=until, bucket=bucket, tier_ids=tier_ids).items() if pk in instances}
    seconds = bucket.total_seconds()
    line = functools.partial(_chart, colours=tier_colours(tiers), span=length, until=until)
    charts = [
        line("latency-chart", "End-to-end latency (ms)", "ms", traffic,
               lambda p: p.latency_p50, lambda p: p.latency_p95),
        line("ttft-chart", "Time to first token, streamed (ms)", "ms", traffic,
               lambda p: p.ttft_p50, lambda p: p.ttft_p95),
        line("error-rate-chart", "Error rate, 5xx (%)", "%", traffic, lambda p: 100 * p.error_rate),
        line("requests-chart", "Requests per second", "req/s", traffic, lambda p: p.requests / seconds),
        line("tokens-chart", "Tokens per second (prompt and output)", "tokens/s", traffic,
               lambda p: p.tokens / seconds),
        line("queue-chart", "Engine queue depth (waiting requests)", "requests", engines, lambda p: p.waiting),
        line("kv-chart", "Engine KV cache use (%)", "%", engines, lambda p: 100 * p.kv_cache_usage),
        line("engine-tokens-chart", "Engine tokens per second", "tokens/s", engines, lambda p: p.tokens_per_s),
        line("engine-ttft-chart", "Engine time to first token (s), its own histogram", "s", engines,
               lambda p: p.ttft_p50, lambda p: p.ttft_p95),
        line("prefix-cache-chart", "Prefix cache hit rate (% of prompt tokens looked up)", "%", engines,
               lambda p: None if p.prefix_hit_rate is None else 100 * p.prefix_hit_rate),
        line("mm-cache-chart", "Image cache hit rate (% of images looked up)", "%", engines,
               lambda p: None if p.mm_hit_rate is None else 100 * p.mm_hit_rate),
    ]
    return render(request, "fleet/operations.html", {
        "charts": charts, "windows": list(WINDOWS), "window": window, "tiers": tiers, "chosen": chosen,
        "bucket": bucket, "nodes": node_summaries(), "totals": _totals(traffic, length),
        "class_tables": _by_class(tiers, instances, since=until - length, until=until, tier_ids=tier_ids),
    })


def _by_class(tiers, instances, *, since, until, tier_ids) -> list[tuple[str, str, list[dict]]]:
    """Text, image and large-image requests apart, per tier and per engine: what an image burst
    does to the text beside it shows here, where one figure per tier would hide it."""
    by_id = {t.pk: t for t in tiers}
    order = {kind: n for n, kind in enumerate(CLASSES)}
    rows: dict[str, list[dict]] = {"tiers": [], "engines": []}
    for by, owners, label in (("tier", by_id, lambda t: t.name),
                              ("engine", instances, _engine_label)):
        found = latency_by_class(since=since, until=until, by=by, tier_ids=tier_ids)
        for (owner, kind), figures in sorted(found.items(), key=lambda item: (item[0][0], order[item[0][1]])):
            if owner not in owners:
                continue
            tier = owners[owner] if by == "tier" else owners[owner].tier
            objective = tier.ttft_objectives().get(kind)
            rows["tiers" if by == "tier" else "engines"].append({
                "owner": label(owners[owner]), "kind": kind, "figures": figures, "objective": objective,
                "breached": objective is not None and figures.first_token[1] > objective})
    return [("tiers", "Model", rows["tiers"]), ("engines", "Engine", rows["engines"])]


def _engine_label(instance: EngineInstance) -> str:
    where = f" on {instance.node.name}" if instance.node else ""
    return f"{instance.tier.name}#{instance.pk}{where}"


def _chart(div_id: str, *args, **kwargs) -> dict:
    return {"id": div_id, "html": operations_chart(div_id, *args, **kwargs)}


def _totals(traffic: dict[str, list], length: dt.timedelta) -> list[dict]:
    """Per tier over the whole window: requests, errors and the share they are."""
    rows = []
    for name, points in sorted(traffic.items()):
        requests, errors = sum(p.requests for p in points), sum(p.errors for p in points)
        rows.append({"tier": name, "requests": requests, "errors": errors,
                     "error_rate": 100 * errors / requests if requests else 0,
                     "per_second": requests / length.total_seconds()})
    return rows
