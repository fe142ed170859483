from __future__ import annotations

import datetime as dt

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.catalog.services import resolution_curves
from controlplane.dashboard.charts import resolution_curves_chart
from controlplane.fleet.models import EngineEvent, EngineInstance
from controlplane.metering.charts import (
    cache_savings_chart,
    cost_chart,
    cost_per_image_chart,
    image_tokens_chart,
)
from controlplane.metering.selectors import image_count_disagreements
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

# The tenants drawn one by one in the per-tenant charts; the rest are summed as "others".
TOP_TENANTS = 10


def _require(check, user):
    if not check(user):
        raise PermissionDenied


@login_required
def index(request):
    """Usage from the rollups: image tokens, cost and cache savings over time per tier (and per
    tenant for staff), the cost of one image, each tier's resolution-to-tokens curve, totals.

    ?period=24h|30d|90d, ?tier=NAME, and for operators and finance ?tenant=NAME.
    """
    _require(roles.can_see_usage, request.user)
    from controlplane.catalog.models import ModelTier

    staff = roles.is_operator(request.user) or roles.is_finance(request.user)
    visible = roles.visible_tenants(request.user)
    tenants = list(visible.order_by("name")) if staff else []
    tiers = list(ModelTier.objects.order_by("name"))
    tenant = next((t for t in tenants if t.name == request.GET.get("tenant")), None)
    tier = next((t for t in tiers if t.name == request.GET.get("tier")), None)
    period = PERIODS.get(request.GET.get("period"), PERIODS[DEFAULT_PERIOD])
    scope = UsageScope(tenants=[tenant] if tenant else visible, tier=tier, period=period, now=timezone.now())

    by_tier = usage_over_time(scope=scope, by="tier")
    # A tenant admin's usage is one tenant's: splitting it per tenant would say nothing.
    by_tenant = usage_over_time(scope=scope, by="tenant") if staff and tenant is None else None
    table = usage_table(scope=scope)
    totals = usage_totals(table)
    currency = currency_label(totals)
    distribution = image_cost_distribution(scope=scope)
    curves = resolution_curves(tier=tier)
    return render(request, "dashboard/index.html", {
        "period": period, "periods": PERIODS.values(), "tenant": tenant, "tier": tier,
        "tenants": tenants, "tiers": tiers,
        "has_data": bool(table),
        "chart": image_tokens_chart(scope.slots, by_tier.of("image_tokens")),
        "cost_chart": cost_chart(scope.slots, by_tier.of("cost"), currency=currency),
        "tenant_charts": [
            image_tokens_chart(scope.slots, by_tenant.of("image_tokens", top=TOP_TENANTS), by="tenant"),
            # a tenant's cost is summed over its tiers: only where they bill in one currency
            *([cost_chart(scope.slots, by_tenant.of("cost", top=TOP_TENANTS), currency=currency, by="tenant")]
              if totals["currency"] else []),
        ] if by_tenant else [],
        "savings_chart": cache_savings_chart(scope.slots, by_tier.of("cache_savings"), by_tier.of("cached_image_tokens"),
                                             total=totals["cache_savings"], currency=currency),
        "distribution": distribution,
        "distribution_chart": cost_per_image_chart(distribution, currency=currency, since=scope.first_day)
        if distribution.buckets else "",
        "curves_chart": resolution_curves_chart(curves, div_id="tier-resolution-curves") if curves else "",
        "table": table, "totals": totals,
        "first_day": scope.first_day, "last_day": scope.last_day,
    })


@login_required
def fleet(request):
    _require(roles.is_operator, request.user)
    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.models import Node

    instances = list(EngineInstance.objects.select_related("tier", "node").prefetch_related("gpus").order_by(
        "tier__name", "id"))
    tiers = list(ModelTier.objects.exclude(engine_kind=ModelTier.EngineKind.EXTERNAL).order_by("name"))
    for tier in tiers:
        tier.wanted_running = sum(1 for i in instances if i.tier_id == tier.pk and i.pool == "standard"
                                  and i.desired_state == "running")
        tier.serving = sum(1 for i in instances if i.tier_id == tier.pk and i.pool == "standard"
                           and i.actual_state == "running" and i.healthy)
    return render(request, "dashboard/fleet.html", {
        "nodes": Node.objects.prefetch_related("gpus__instances").order_by("name"),
        "instances": instances, "tiers": tiers,
        "events": EngineEvent.objects.select_related("instance__tier")[:40],
        "external_tiers": ModelTier.objects.filter(engine_kind=ModelTier.EngineKind.EXTERNAL),
        "disagreements": image_count_disagreements(since=timezone.now() - dt.timedelta(hours=24)),
    })


@login_required
def fleet_instance(request, pk: int):
    _require(roles.is_operator, request.user)
    instance = get_object_or_404(EngineInstance.objects.select_related("tier", "node"), pk=pk)
    from controlplane.dashboard.charts import engine_load_chart

    samples = list(instance.samples.all()[:360])  # the last half hour at the default 5 s pass
    return render(request, "dashboard/fleet_instance.html", {
        "instance": instance,
        "events": instance.events.all()[:50],
        "chart": engine_load_chart(samples) if samples else "",
    })


@login_required
@require_POST
def fleet_action(request, pk: int, action: str):
    _require(roles.is_operator, request.user)
    from django.db import transaction

    from controlplane.fleet.services import FleetActionRefused, instance_action
    from controlplane.fleet.tasks import fleet_reconcile

    instance = get_object_or_404(EngineInstance.objects.select_related("tier"), pk=pk)
    if action not in ("launch", "stop", "drain"):
        raise PermissionDenied
    try:
        done = instance_action(instance=instance, action=action, user=request.user,
                               replace=request.POST.get("replace") == "1")
    except FleetActionRefused as exc:
        messages.error(request, str(exc))
    else:
        transaction.on_commit(_reconcile_soon(fleet_reconcile))  # act now rather than at the next beat tick
        messages.success(request, done)
    return redirect("dashboard:fleet")


def _reconcile_soon(task):
    def send():
        try:
            task.delay()
        except Exception:  # noqa: BLE001 - the broker is away: the next beat tick does it
            pass
    return send


@login_required
@require_POST
def fleet_replicas(request, name: str):
    """Set how many replicas a tier wants: the control of the fleet."""
    _require(roles.is_operator, request.user)
    from django.db import transaction

    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.services import tier_replicas_set
    from controlplane.fleet.tasks import fleet_reconcile

    tier = get_object_or_404(ModelTier, name=name)
    try:
        replicas = int(request.POST.get("replicas", ""))
        if not 0 <= replicas <= 64:
            raise ValueError
    except ValueError:
        messages.error(request, "Replicas must be a whole number from 0 to 64.")
        return redirect("dashboard:fleet")
    tier_replicas_set(tier=tier, replicas=replicas, actor=request.user.get_username())
    transaction.on_commit(_reconcile_soon(fleet_reconcile))
    messages.success(request, f"{tier.name} now wants {replicas} replica{'s' * (replicas != 1)}"
                              + ("" if tier.enabled else " (it is disabled: none run until it is enabled)") + ".")
    return redirect("dashboard:fleet")


@login_required
@require_POST
def fleet_register_external(request):
    _require(roles.is_operator, request.user)
    from django import forms

    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.services import FleetActionRefused, external_engine_register

    try:  # the field turns any value that is not a tier's id into a ValidationError
        tier = forms.ModelChoiceField(ModelTier.objects.filter(engine_kind=ModelTier.EngineKind.EXTERNAL)).clean(
            request.POST.get("tier"))
    except forms.ValidationError:
        raise Http404("no such external tier") from None
    url = (request.POST.get("url") or "").strip()
    try:
        external_engine_register(tier=tier, url=url, actor=request.user.username)
    except FleetActionRefused as refused:
        messages.error(request, str(refused))
        return redirect("dashboard:fleet")
    messages.success(request, f"Registered {url} for {tier.name}; it joins rotation once healthy.")
    return redirect("dashboard:fleet")


@login_required
def policies(request):
    """Drop in a sample image: what each vision tier makes of it, and what it would cost."""
    _require(lambda u: roles.is_operator(u) or roles.is_finance(u), request.user)
    from controlplane.catalog.models import ResolutionPolicy
    from controlplane.catalog.services import policy_preview, resolution_curve, vision_tiers
    from controlplane.dashboard.charts import resolution_curves_chart
    from controlplane.dashboard.forms import PolicyPreviewForm

    form = PolicyPreviewForm(request.POST or None, request.FILES or None)
    preview = source = commercial = error = None
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data["image"].read()
        source, error = _source_size(data)
        if source:
            from controlplane.imaging.commercial import commercial_costs

            preview = policy_preview(data=data, detail=form.cleaned_data["detail"])
            commercial = commercial_costs(*source, detail=form.cleaned_data["detail"])
    tiers = list(vision_tiers())
    return render(request, "dashboard/policies.html", {
        "form": form, "preview": preview, "source": source, "commercial": commercial, "error": error,
        "tiers": tiers, "policies": ResolutionPolicy.objects.order_by("name"),
        "chart": resolution_curves_chart({t.name: resolution_curve(t) for t in tiers}) if tiers else "",
    })


def _source_size(data: bytes):
    """The upright size of an uploaded image, or the reason it cannot be read."""
    from controlplane.imaging.decode import open_image, orientation
    from controlplane.imaging.errors import ImageError

    try:
        image = open_image(data, allowed_formats=(), max_input_pixels=200_000_000)
    except ImageError as exc:
        return None, str(exc)
    width, height = image.size
    return ((height, width) if orientation(image) in (5, 6, 7, 8) else (width, height)), None


@login_required
def capacity(request):
    """The KV estimator's answers for a model, a GPU and a traffic mix."""
    _require(roles.is_operator, request.user)
    from controlplane.dashboard.forms import CapacityForm
    from controlplane.imaging import kv

    form = CapacityForm(request.GET or None)
    result = None
    if form.is_valid():
        data = form.cleaned_data
        arch = kv.PRESETS[data["model"]]
        deployment = kv.Deployment(arch, kv.GPUS[data["gpu"]], tensor_parallel=data["tensor_parallel"],
                                   gpu_memory_utilization=data["gpu_memory_utilization"],
                                   kv_cache_dtype=data["kv_cache_dtype"])
        options = {"max_pixels": data["max_pixels"]}
        size = (data["image_width"], data["image_height"])
        mix = [kv.RequestClass(1 - data["image_share"], data["text_tokens"], data["output_tokens"]),
               kv.RequestClass(data["image_share"], data["text_tokens"], data["output_tokens"], (size,))]
        result = {
            "deployment": deployment,
            "per_token": kv.kv_bytes_per_token(arch, kv_cache_dtype=data["kv_cache_dtype"]),
            "per_token_gpu": deployment.kv_bytes_per_token_per_gpu,
            "weights_gib": deployment.weights_bytes_per_gpu / kv.GIB,
            "image_tokens": kv.image_tokens(arch, *size, **options),
            "image_mib": kv.image_kv_bytes(arch, *size, kv_cache_dtype=data["kv_cache_dtype"], **options) / 2**20,
            "fit": kv.concurrency(deployment, mix, **options),
            "largest": kv.largest_resolution(deployment, target_concurrency=data["target_concurrency"],
                                             aspect=size, text_tokens=data["text_tokens"],
                                             output_tokens=data["output_tokens"]),
        }
    return render(request, "dashboard/capacity.html", {"form": form, "result": result})
