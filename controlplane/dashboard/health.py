"""The operator's home page: the service's health at a glance, read in a few bounded queries.

Engines by state per tier, nodes and their GPUs, the alerts firing, each tier's last hour of
traffic (requests, error rate, first token), the tenants spending most today, the tenants near
a quota or budget and the keys near a budget of their own, and the last hour's requests refused
with no key of ours (from Redis)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Count, Q, Sum

from controlplane.alerts.models import Alert
from controlplane.catalog.models import ModelTier
from controlplane.fleet.glance import TierHealth, tiers_health
from controlplane.fleet.models import Node
from controlplane.fleet.selectors import HEALTH_FRESH_SECONDS
from controlplane.gateway.refusals import KeylessCount, keyless_refusals
from controlplane.metering.models import DailyUsage
from controlplane.metering.selectors import keys_budget, quota_shares
from controlplane.tenants.models import ApiKey, Tenant

TOP_SPENDERS = 5
NEAR_QUOTA_PERCENT = 80
# Nodes whose agent has not reported for this long are shown as silent.
NODE_SILENT_SECONDS = 3 * HEALTH_FRESH_SECONDS
SHOWN_ALERTS = 10


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
    keyless: KeylessCount | None  # None: not counted here (no Redis, or it did not answer)

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
    tiers = tiers_health(list(ModelTier.objects.order_by("-enabled", "name")), now=now)
    return Health(
        tiers=tiers, nodes=_nodes(now), alerts=_alerts(),
        alerts_firing=Alert.objects.filter(state=Alert.State.FIRING).count(),
        top_spenders=_top_spenders(now.date()), near_quota=_near_quota(now),
        keyless=keyless_refusals(now=now.timestamp()))


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
    """Today's spend per client tenant (not the service's own traffic) and currency, from the
    daily rollups, largest first."""
    rows = (DailyUsage.objects.filter(day=day, tenant__internal=False)
            .values("tenant__name", "tier__price_plan__currency")
            .annotate(cost=Sum("cost"), requests=Sum("requests")).filter(cost__gt=0).order_by("-cost"))
    return [{"tenant": row["tenant__name"], "currency": row["tier__price_plan__currency"] or "",
             "cost": row["cost"], "requests": row["requests"]} for row in rows[:TOP_SPENDERS]]


def _near_quota(now: dt.datetime) -> list[dict]:
    """Per tenant, its limits and its keys' budgets used to NEAR_QUOTA_PERCENT or more, most
    used first; the tenant nearest a limit first."""
    near: dict[str, list[dict]] = {}
    for name, row in [*_tenant_limits_near(now), *_key_budgets_near(now)]:
        near.setdefault(name, []).append(row)
    rows = {name: sorted(limits, key=lambda row: -row["pct"]) for name, limits in near.items()}
    return [{"tenant": name, "limits": limits} for name, limits in sorted(rows.items(), key=lambda item: -item[1][0]["pct"])]


def _tenant_limits_near(now: dt.datetime) -> list[tuple[str, dict]]:
    tenants = [tenant for tenant in Tenant.objects.filter(active=True).select_related("quota").order_by("name")
               if getattr(tenant, "quota", None) is not None and not tenant.quota.unlimited]
    shares = quota_shares(tenants, now=now)
    return [(tenant.name, row) for tenant in tenants for row in shares[tenant.pk] if row["pct"] >= NEAR_QUOTA_PERCENT]


def _key_budgets_near(now: dt.datetime) -> list[tuple[str, dict]]:
    """Keys of active tenants near a budget of their own, as rows like a tenant's limits: a
    key refused once its budget is spent stops its client as surely as its tenant's quota."""
    usable = Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    keys = list(ApiKey.objects.filter(usable, spend_limit__isnull=False, revoked_at__isnull=True, tenant__active=True)
                .select_related("tenant", "tenant__quota"))
    budgets = keys_budget(keys, now=now)
    return [(key.tenant.name, _key_row(key, budget)) for key in keys
            if (budget := budgets[key.pk]).pct >= NEAR_QUOTA_PERCENT]


def _key_row(key: ApiKey, budget) -> dict:
    return {"label": f"Budget of key {key.name or 'unnamed'} (vlm-{key.prefix}-…)", "key": key, "money": True,
            "used": budget.spent, "limit": budget.limit, "currency": budget.currency, "pct": budget.pct,
            "share": round(budget.pct)}
