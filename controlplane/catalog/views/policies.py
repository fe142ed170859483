"""Resolution policies: what each vision tier makes of a sample image (operators and finance),
and the policy editor for operators: every bound checked by the model, and a preview of what
sample photos become under the policy (sizes, tokens and cost on each vision tier, as if that
tier used it) before saving."""

from __future__ import annotations

import copy

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, field_values, history
from controlplane.benchmarks import gates
from controlplane.catalog.charts import resolution_curves_chart
from controlplane.catalog.forms import PolicyForm, PolicyPreviewForm
from controlplane.catalog.models import ModelTier, ResolutionPolicy
from controlplane.catalog.services import resolution_curve, vision_tiers
from controlplane.catalog.views.preview import engine_image_bounds, rates_now, samples
from controlplane.imaging.commercial import commercial_costs
from controlplane.imaging.decode import open_image, orientation
from controlplane.imaging.errors import ImageError
from controlplane.metering.previews import policy_preview
from controlplane.metering.ratebook import RateBook
from controlplane.web.access import operators_only, staff_only


@login_required
def policies(request):
    """Drop in a sample image: what each vision tier makes of it, and what it would cost."""
    staff_only(request)
    form = PolicyPreviewForm(request.POST or None, request.FILES or None)
    preview = source = commercial = error = None
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data["image"].read()
        source, error = _source_size(data)
        if source:
            preview = policy_preview(data=data, detail=form.cleaned_data["detail"])
            commercial = commercial_costs(*source, detail=form.cleaned_data["detail"])
    tiers = list(vision_tiers())
    return render(request, "catalog/policies.html", {
        "form": form, "preview": preview, "source": source, "commercial": commercial, "error": error,
        "tiers": tiers, "policies": ResolutionPolicy.objects.order_by("name"),
        "chart": resolution_curves_chart({t.name: resolution_curve(t) for t in tiers}) if tiers else "",
    })


def _source_size(data: bytes):
    """The upright size of an uploaded image, or the reason it cannot be read."""
    try:
        image = open_image(data, allowed_formats=(), max_input_pixels=200_000_000)
    except ImageError as exc:
        return None, str(exc)
    width, height = image.size
    return ((height, width) if orientation(image) in (5, 6, 7, 8) else (width, height)), None


@login_required
def policy_new(request):
    operators_only(request)
    return _policy_form(request, ResolutionPolicy())


@login_required
def policy_edit(request, name):
    operators_only(request)
    return _policy_form(request, get_object_or_404(ResolutionPolicy, name=name))


def _policy_form(request, policy: ResolutionPolicy):
    creating = policy.pk is None
    saved = None if creating else ResolutionPolicy.objects.get(pk=policy.pk)
    before = {} if creating else field_values(saved, PolicyForm.Meta.fields)
    form = PolicyForm(request.POST or None, instance=policy)
    preview = None
    if request.method == "POST" and form.is_valid():
        gated = [] if creating else gates.gated_tiers(saved)
        if "save" in request.POST and gated and form.has_changed():
            # Not saved: measured first on the gated tiers; applied from the check.
            check = gates.check_start(policy=saved, proposed=form.instance, user=request.user)
            messages.info(request, f"{', '.join(t.name for t in gated)} {'is' if len(gated) == 1 else 'are'} "
                                   f"gated: the change is being measured before it goes live.")
            return redirect("benchmarks:gate-check", pk=check.pk)
        if "save" in request.POST:
            policy = form.save()
            audit_record(actor=request.user.get_username(),
                         action=AuditEntry.Action.CREATED if creating else AuditEntry.Action.CHANGED,
                         obj=policy, before=before, after=field_values(policy, PolicyForm.Meta.fields))
            messages.success(request, f"Policy {policy.name} {'created' if creating else 'saved'}.")
            return redirect("dashboard:policy-edit", name=policy.name)
        preview = _preview(form.instance)
    elif not creating:
        # Not `policy`: a form that failed its checks has written what it was sent there.
        preview = _preview(saved)
    used_by = [] if creating else list(policy.tiers.order_by("name"))
    return render(request, "catalog/policy_form.html", {
        "form": form, "policy": policy, "creating": creating, "preview": preview, "used_by": used_by,
        "engine_bounds": [(tier, engine_image_bounds(tier)) for tier in used_by
                          if tier.kind == ModelTier.Kind.VISION],
        "gated": [] if creating else gates.gated_tiers(saved),
        "history": [] if creating else history(policy)[:20]})


def _preview(policy: ResolutionPolicy) -> list[dict]:
    """For each vision tier, what sample photos cost under `policy` (unsaved as it may be)."""
    found = []
    tiers = list(ModelTier.objects.filter(kind=ModelTier.Kind.VISION).select_related("price_plan").order_by("name"))
    book = RateBook().load(tier.price_plan_id for tier in tiers)  # every plan's rates at once
    for tier in tiers:
        trial = copy.copy(tier)
        trial.resolution_policy = policy
        found.append({"tier": tier, "samples": samples(trial, rates_now(tier, book)),
                      "currency": tier.price_plan.currency})
    return found
