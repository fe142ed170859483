"""The fleet for operators: nodes, engines and their events, each tier's replicas (the
control of the fleet), one engine's load, starting, stopping and draining engines, and
external engines registered by URL."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.catalog.charts import tier_colours
from controlplane.catalog.models import MAX_REPLICAS, ModelTier
from controlplane.fleet.charts import engine_load_chart
from controlplane.fleet.kv_check import kv_check
from controlplane.fleet.models import EngineEvent, EngineInstance, Node
from controlplane.fleet.services import (
    FleetActionRefused,
    external_engine_register,
    instance_action,
    tier_replicas_set,
)
from controlplane.fleet.tasks import fleet_reconcile
from controlplane.metering.selectors import image_count_disagreements
from controlplane.web.access import operators_only


@login_required
def fleet(request):
    operators_only(request)
    instances = list(EngineInstance.objects.select_related("tier", "node").prefetch_related("gpus").order_by(
        "tier__name", "id"))
    tiers = list(ModelTier.objects.exclude(engine_kind=ModelTier.EngineKind.EXTERNAL).order_by("name"))
    for tier in tiers:
        tier.wanted_running = sum(1 for i in instances if i.tier_id == tier.pk and i.pool == "standard"
                                  and i.desired_state == "running")
        tier.serving = sum(1 for i in instances if i.tier_id == tier.pk and i.pool == "standard"
                           and i.actual_state == "running" and i.healthy)
    return render(request, "fleet/fleet.html", {
        "nodes": Node.objects.prefetch_related("gpus__instances").order_by("name"),
        "instances": instances, "tiers": tiers,
        "events": EngineEvent.objects.select_related("instance__tier")[:40],
        "external_tiers": ModelTier.objects.filter(engine_kind=ModelTier.EngineKind.EXTERNAL),
        "disagreements": image_count_disagreements(since=timezone.now() - dt.timedelta(hours=24)),
    })


@login_required
def fleet_instance(request, pk: int):
    operators_only(request)
    instance = get_object_or_404(EngineInstance.objects.select_related("tier", "node"), pk=pk)
    samples = list(instance.samples.all()[:360])  # the last half hour at the default 5 s pass
    return render(request, "fleet/fleet_instance.html", {
        "instance": instance,
        "events": instance.events.all()[:50],
        "chart": engine_load_chart(samples, tier=instance.tier.name, colours=tier_colours()),
        "kv": kv_check(instance),
    })


@login_required
@require_POST
def fleet_action(request, pk: int, action: str):
    operators_only(request)

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
    operators_only(request)

    tier = get_object_or_404(ModelTier, name=name)
    try:
        replicas = int(request.POST.get("replicas", ""))
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValueError
    except ValueError:
        messages.error(request, f"Replicas must be a whole number from 0 to {MAX_REPLICAS}.")
        return redirect("dashboard:fleet")
    tier_replicas_set(tier=tier, replicas=replicas, actor=request.user.get_username())
    transaction.on_commit(_reconcile_soon(fleet_reconcile))
    messages.success(request, f"{tier.name} now wants {replicas} replica{'s' * (replicas != 1)}"
                              + ("" if tier.enabled else " (it is disabled: none run until it is enabled)") + ".")
    return redirect("dashboard:fleet")


@login_required
@require_POST
def fleet_register_external(request):
    operators_only(request)

    try:  # the field turns any value that is not a tier's id into a ValidationError
        tier = forms.ModelChoiceField(ModelTier.objects.filter(engine_kind=ModelTier.EngineKind.EXTERNAL)).clean(
            request.POST.get("tier"))
    except forms.ValidationError:
        raise Http404("no such external tier") from None
    url = (request.POST.get("url") or "").strip()
    try:
        external_engine_register(tier=tier, url=url, actor=request.user.username,
                                 served_model_name=request.POST.get("served_model_name") or "")
    except FleetActionRefused as refused:
        messages.error(request, str(refused))
        return redirect("dashboard:fleet")
    messages.success(request, f"Registered {url} for {tier.name}; it joins rotation once healthy.")
    return redirect("dashboard:fleet")
