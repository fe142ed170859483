"""Tier pages for operators: the list, one form per engine kind to create or edit a tier with
a preview of what it will do, and enabling or disabling it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Count, Q, Sum
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.audit.services import history
from controlplane.benchmarks import gates
from controlplane.catalog.changes import tier_save, tier_set_enabled
from controlplane.catalog.forms import TierForm
from controlplane.catalog.models import ModelTier
from controlplane.catalog.routing import resolve_auto
from controlplane.catalog.views.preview import tier_plan
from controlplane.fleet.glance import tiers_health
from controlplane.metering.models import DailyUsage
from controlplane.web.access import operators_only

ENGINE_KINDS = dict(ModelTier.EngineKind.choices)



@login_required
def tier_list(request):
    operators_only(request)
    tiers = ModelTier.objects.select_related("resolution_policy", "price_plan").annotate(
        running=Count("instances", filter=Q(instances__actual_state="running"))).order_by("name")
    enabled = [tier for tier in tiers if tier.enabled]
    return render(request, "catalog/tiers.html", {
        "tiers": tiers, "engine_kinds": ENGINE_KINDS,
        "auto_text": resolve_auto(enabled, has_images=False), "auto_images": resolve_auto(enabled, has_images=True)})


@login_required
def tier_new(request):
    operators_only(request)
    engine_kind = request.GET.get("engine") or request.POST.get("engine_kind") or ModelTier.EngineKind.VLLM
    if engine_kind not in ENGINE_KINDS:
        raise Http404("no such engine kind")
    return _tier_form(request, ModelTier(engine_kind=engine_kind, enabled=False), engine_kind)


@login_required
def tier_edit(request, name):
    operators_only(request)
    tier = get_object_or_404(ModelTier.objects.select_related("resolution_policy", "price_plan"), name=name)
    engine_kind = request.GET.get("engine") or request.POST.get("engine_kind") or tier.engine_kind
    if engine_kind not in ENGINE_KINDS:
        raise Http404("no such engine kind")
    return _tier_form(request, tier, engine_kind)


def _tier_form(request, tier: ModelTier, engine_kind: str):
    """GET shows the form (and, for a saved tier, what it does); POST with `preview` shows what
    the tier would do without saving; POST with `save` saves it, checked as the model checks."""
    creating = tier.pk is None
    form = TierForm(request.POST or None, instance=tier, engine_kind=engine_kind)
    plan = None
    if request.method == "POST" and form.is_valid():
        saved = None if creating else ModelTier.objects.get(pk=tier.pk)
        if "save" in request.POST and saved is not None and gates.tier_change_gated(saved, form.instance):
            # Not saved: measured first on a candidate engine; applied from the check.
            check = gates.tier_check_start(tier=saved, proposed=form.save(commit=False), user=request.user)
            messages.info(request, f"{saved.name} is gated: the change is measured on a candidate engine "
                                   f"before it goes live.")
            return redirect("benchmarks:gate-check", pk=check.pk)
        if "save" in request.POST:
            took = {flag: ModelTier.objects.filter(**{flag: True}).exclude(pk=tier.pk).first()
                    for flag in ("default_for_text", "default_for_images") if form.cleaned_data.get(flag)}
            tier = tier_save(tier=form.save(commit=False), actor=request.user.get_username())
            messages.success(request, f"Tier {tier.name} {'created' if creating else 'saved'}.")
            for flag, previous in took.items():
                if previous is not None:
                    kind = "text" if flag == "default_for_text" else "images"
                    messages.info(request, f"`auto` now sends {kind} requests to {tier.name} instead of "
                                           f"{previous.name}.")
            return redirect("dashboard:tier-edit", name=tier.name)
        plan = tier_plan(form.instance)
    elif request.method == "GET" and not creating:
        plan = tier_plan(tier)
    return render(request, "catalog/tier_form.html", {
        "glance": None if creating else _glance(tier, timezone.now()),
        "form": form, "tier": tier, "creating": creating, "engine_kind": engine_kind,
        "engine_label": ENGINE_KINDS[engine_kind], "engine_kinds": ENGINE_KINDS, "plan": plan,
        "history": history(tier)[:20] if not creating else [],
    })


@login_required
@require_POST
def tier_enable(request, name, enabled: bool):
    operators_only(request)
    tier = get_object_or_404(ModelTier, name=name)
    try:
        tier_set_enabled(tier=tier, enabled=enabled, actor=request.user.get_username())
    except ValidationError as exc:
        messages.error(request, f"Tier {tier.name} was not enabled: {' '.join(exc.messages)}")
    else:
        messages.success(request, f"Tier {tier.name} {'enabled' if enabled else 'disabled'}.")
    return redirect("dashboard:tiers")


def _glance(tier: ModelTier, now) -> dict:
    """The tier at work (its engines, those serving, its last hour) and what it billed this month."""
    # Billed as the month's statements bill it: the service's own traffic is billed to no one.
    month = DailyUsage.objects.filter(tier=tier, day__gte=now.date().replace(day=1), tenant__internal=False).aggregate(
        cost=Sum("cost"))
    return {"health": tiers_health([tier], now=now)[0], "month_cost": month["cost"] or 0,
            "currency": tier.price_plan.currency}
