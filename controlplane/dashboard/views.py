"""The home page (an operator's: the service's health; anyone else's: their usage) and the
usage page: the reader's usage, read from the metering rollups, and each vision tier's
resolution curve."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from django.utils import timezone

from controlplane.catalog.charts import resolution_curves_chart, tier_colours
from controlplane.catalog.models import ModelTier
from controlplane.catalog.services import resolution_curves
from controlplane.dashboard.health import service_health
from controlplane.metering.charts import (
    cache_savings_chart,
    cost_chart,
    cost_per_image_chart,
    image_tokens_chart,
)
from controlplane.metering.usage import (
    DEFAULT_PERIOD,
    PERIODS,
    UsageScope,
    currency_label,
    image_cost_distribution,
    usage_over_time,
    usage_table,
    usage_totals,
)
from controlplane.tenants import roles
from controlplane.tenants.models import ApiKey

# The tenants drawn one by one in the per-tenant charts; the rest are summed as "others".
TOP_TENANTS = 10


def _require(check, user):
    if not check(user):
        raise PermissionDenied


@login_required
def index(request):
    """An operator's home is the service's health; every other role's is its usage."""
    if roles.is_operator(request.user):
        return render(request, "dashboard/health.html", {"health": service_health(now=timezone.now())})
    return usage(request)


@login_required
def usage(request):
    """Usage from the rollups: image tokens, cost and cache savings over time per tier (and per
    tenant for staff), the cost of one image, each tier's resolution-to-tokens curve, totals.

    ?period=24h|30d|90d, ?tier=NAME, and for operators and finance ?tenant=NAME.
    """
    _require(roles.can_see_usage, request.user)
    staff = roles.is_operator(request.user) or roles.is_finance(request.user)
    visible = roles.visible_tenants(request.user)
    tenants = list(visible.order_by("name")) if staff else []
    tiers = list(ModelTier.objects.select_related("price_plan").order_by("name"))
    tenant = next((t for t in tenants if t.name == request.GET.get("tenant")), None)
    tier = next((t for t in tiers if t.name == request.GET.get("tier")), None)
    period = PERIODS.get(request.GET.get("period"), PERIODS[DEFAULT_PERIOD])
    # The keys to choose from: one tenant's (every tenant's keys may be thousands); any key the
    # reader may see is found by its prefix.
    keys = list(ApiKey.objects.filter(tenant__in=[tenant] if tenant else visible).select_related("tenant")
                .order_by("tenant__name", "name", "prefix")) if tenant or not staff else []
    api_key = next((k for k in keys if k.prefix == request.GET.get("key")), None) or (
        ApiKey.objects.filter(tenant__in=visible, prefix=request.GET["key"]).select_related("tenant").first()
        if request.GET.get("key") and not keys else None)
    asked = request.GET.get("tenant")  # a tenant admin's tenants are read only when one is named
    refused = _refused_filters(request.GET, period=period, tier=tier,
                               tenant_names={t.name for t in (tenants if staff else visible)} if asked else set(),
                               api_key=api_key)
    # Every tenant is every client's: the service's own traffic is shown apart.
    scope = UsageScope(tenants=[] if refused else [tenant] if tenant else visible.filter(internal=False), tier=tier,
                       period=period, now=timezone.now(), api_key=api_key)
    if api_key is not None:  # one key's usage: whichever tenant's it is
        scope = dataclasses.replace(scope, tenants=[api_key.tenant])
    internal = None
    if staff and tenant is None and api_key is None and not refused:
        internal_table = usage_table(scope=UsageScope(tenants=visible.filter(internal=True), tier=tier, period=period,
                                                      now=scope.now))
        internal = usage_totals(internal_table) if internal_table else None

    by_tier = usage_over_time(scope=scope, by="tier")
    # A tenant admin's usage is one tenant's: splitting it per tenant would say nothing.
    by_tenant = usage_over_time(scope=scope, by="tenant") if staff and tenant is None and api_key is None else None
    table = usage_table(scope=scope)
    totals = usage_totals(table)
    currency = currency_label(totals)
    # Images' costs are kept per tenant and tier, not per key.
    distribution = image_cost_distribution(scope=scope) if api_key is None else None
    curves = resolution_curves(tier=tier)
    colours = tier_colours(tiers)
    return render(request, "dashboard/index.html", {
        "period": period, "periods": PERIODS.values(), "tenant": tenant, "tier": tier,
        "tenants": tenants, "tiers": tiers, "refused": refused,
        "has_data": bool(table),
        "chart": image_tokens_chart(scope.slots, by_tier.of("image_tokens"), colours=colours),
        "cost_chart": cost_chart(scope.slots, by_tier.of("cost"), currency=currency, colours=colours),
        "tenant_charts": [
            image_tokens_chart(scope.slots, by_tenant.of("image_tokens", top=TOP_TENANTS), by="tenant"),
            # a tenant's cost is summed over its tiers: only where they bill in one currency
            *([cost_chart(scope.slots, by_tenant.of("cost", top=TOP_TENANTS), currency=currency, by="tenant")]
              if totals["currency"] else []),
        ] if by_tenant else [],
        "savings_chart": cache_savings_chart(scope.slots, by_tier.of("cache_savings"), by_tier.of("cached_image_tokens"),
                                             total=totals["cache_savings"], currency=currency, colours=colours),
        "distribution": distribution,
        "distribution_chart": cost_per_image_chart(distribution, currency=currency, since=scope.first_day,
                                                   colours=colours)
        if distribution and distribution.buckets else "",
        "keys": keys, "api_key": api_key,
        "curves_chart": resolution_curves_chart(curves, div_id="tier-resolution-curves", colours=colours)
        if curves else "",
        "table": table, "totals": totals, "internal": internal,
        "internal_tenants": [t for t in tenants if t.internal],
        "first_day": scope.first_day, "last_day": scope.last_day,
        "export_query": _images_export_query(scope, tenant=tenant),
        # What nothing spent is counted in: the currencies the tiers shown bill in.
        "plan_currencies": sorted({t.price_plan.currency for t in ([tier] if tier else tiers)}),
    }, status=400 if refused else 200)


def _images_export_query(scope: UsageScope, *, tenant) -> str:
    """The per-image report's query string for what the page shows: its days (whole UTC days,
    as its cost-per-image chart counts them), tenant (a key's, when one key is shown), tier and
    key."""
    query = {"from": scope.first_day.isoformat(), "to": scope.last_day.isoformat()}
    owner = scope.api_key.tenant if scope.api_key is not None else tenant
    if owner is not None:
        query["tenant"] = owner.name
    if scope.tier is not None:
        query["tier"] = scope.tier.name
    if scope.api_key is not None:
        query["key"] = scope.api_key.prefix
    return urlencode(query)


USAGE_FILTERS = ("period", "tenant", "tier", "key")


def _refused_filters(query, *, period, tier, tenant_names: set[str], api_key=None) -> list[str]:
    """What of the page's filter names nothing that exists: a filter silently ignored shows
    figures the reader did not ask for."""
    refused = [f"unknown filter {name!r}" for name in sorted(set(query) - set(USAGE_FILTERS))]
    if query.get("period") and query["period"] != period.key:
        refused.append(f"no period {query['period']!r} (choose {', '.join(PERIODS)})")
    if query.get("tenant") and query["tenant"] not in tenant_names:
        refused.append(f"no tenant {query['tenant']!r} you can see")
    if query.get("tier") and tier is None:
        refused.append(f"no tier {query['tier']!r}")
    if query.get("key") and api_key is None:
        refused.append(f"no API key {query['key']!r} you can see{' of this tenant' if query.get('tenant') else ''}")
    return refused
