"""The operator's home page: the service's health at a glance, read in a few bounded queries.

Engines by state per tier, nodes and their GPUs, the alerts firing, each tier's last hour of
traffic (requests, error rate, first token), the tenants spending most today and the tenants
near a quota."""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from django.db.models import Count, Sum

from controlplane.alerts.models import Alert
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance, Node
from controlplane.fleet.selectors import HEALTH_FRESH_SECONDS, routable_instances
from controlplane.metering.models import DailyUsage
from controlplane.metering.selectors import quotas_use
from controlplane.metering.traffic import traffic_by_tier
from controlplane.tenants.models import Tenant

HOUR = dt.timedelta(hours=1)
TOP_SPENDERS = 5
NEAR_QUOTA_PERCENT = 80
# Nodes whose agent has not reported for this long are shown as silent.
NODE_SILENT_SECONDS = 3 * HEALTH_FRESH_SECONDS
SHOWN_ALERTS = 10


@dataclass
class TierHealth:
    tier: ModelTier
    engines: Counter = field(default_factory=Counter)  # actual state -> count (candidates left out)
    serving: int = 0  # routable now
    requests: int = 0  # in the last hour
    errors: int = 0  # 5xx
    ttft_p50: float | None = None  # ms, streamed requests
    ttft_p95: float | None = None
    latency_p95: float | None = None

    @property
    def error_rate(self) -> float:
        return 100 * self.errors / self.requests if self.requests else 0.0

    @property
    def unserved(self) -> bool:
        return self.tier.enabled and not self.serving

    @property
    def states(self) -> list[tuple[str, int]]:
        return sorted(self.engines.items())


@dataclass
class NodeHealth:
    node: Node
    gpus: int
    engines: int
    silent: bool


@dataclass
class Health:
    tiers: list[TierHealth]
    nodes: list[NodeHealth]
    alerts: list[Alert]
    alerts_firing: int
    top_spenders: list[dict]
    near_quota: list[dict]

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.tiers)

    @property
    def errors(self) -> int:
        return sum(t.errors for t in self.tiers)

    @property
    def error_rate(self) -> float:
        return 100 * self.errors / self.requests if self.requests else 0.0

    @property
    def unserved(self) -> list[TierHealth]:
        return [t for t in self.tiers if t.unserved]

    @property
    def engines_serving(self) -> int:
        return sum(t.serving for t in self.tiers)


def service_health(*, now: dt.datetime) -> Health:
    tiers = {tier.pk: TierHealth(tier=tier) for tier in ModelTier.objects.order_by("-enabled", "name")}
    for row in (EngineInstance.objects.exclude(pool="candidate").values("tier_id", "actual_state")
                .annotate(n=Count("id"))):
        tiers[row["tier_id"]].engines[row["actual_state"]] += row["n"]
    for health in tiers.values():
        if health.tier.enabled:
            health.serving = len(routable_instances(tier_id=health.tier.pk))
    for tier_id, points in traffic_by_tier(since=now - HOUR, until=now, bucket=HOUR).items():
        if tier_id in tiers and points:
            point, health = points[0], tiers[tier_id]
            health.requests, health.errors = point.requests, point.errors
            health.ttft_p50, health.ttft_p95, health.latency_p95 = point.ttft_p50, point.ttft_p95, point.latency_p95
    return Health(
        tiers=list(tiers.values()), nodes=_nodes(now), alerts=_alerts(),
        alerts_firing=Alert.objects.filter(state=Alert.State.FIRING).count(),
        top_spenders=_top_spenders(now.date()), near_quota=_near_quota(now))


def _nodes(now: dt.datetime) -> list[NodeHealth]:
    silent_before = now - dt.timedelta(seconds=NODE_SILENT_SECONDS)
    nodes = Node.objects.annotate(gpu_count=Count("gpus", distinct=True),
                                  engine_count=Count("instances", distinct=True)).order_by("name")
    return [NodeHealth(node=node, gpus=node.gpu_count, engines=node.engine_count,
                       silent=node.last_seen_at is None or node.last_seen_at < silent_before) for node in nodes]


def _alerts() -> list[Alert]:
    return list(Alert.objects.filter(state=Alert.State.FIRING).select_related("rule").order_by("-fired_at")
                [:SHOWN_ALERTS])


def _top_spenders(day: dt.date) -> list[dict]:
    """Today's spend per tenant and currency, from the daily rollups, largest first."""
    rows = (DailyUsage.objects.filter(day=day).values("tenant__name", "tier__price_plan__currency")
            .annotate(cost=Sum("cost"), requests=Sum("requests")).filter(cost__gt=0).order_by("-cost"))
    return [{"tenant": row["tenant__name"], "currency": row["tier__price_plan__currency"] or "",
             "cost": row["cost"], "requests": row["requests"]} for row in rows[:TOP_SPENDERS]]


def _near_quota(now: dt.datetime) -> list[dict]:
    tenants = [tenant for tenant in Tenant.objects.filter(active=True).select_related("quota").order_by("name")
               if getattr(tenant, "quota", None) is not None and not tenant.quota.unlimited]
    near = defaultdict(list)
    use = quotas_use(tenants, now=now)
    for tenant in tenants:
        for row in use[tenant.pk]:
            if row["share"] is not None and row["share"] >= NEAR_QUOTA_PERCENT:
                near[tenant.name].append(row)
    return [{"tenant": name, "limits": rows} for name, rows in sorted(
        near.items(), key=lambda item: -max(row["share"] for row in item[1]))]
