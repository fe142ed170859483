"""Operator pages for quality gates: which tiers are gated on which set, and each check of a
proposed policy change with its figures and the decision on it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, field_values
from controlplane.benchmarks import gates
from controlplane.benchmarks.forms import GateForm, OverrideForm
from controlplane.benchmarks.models import GateCheck, QualityGate
from controlplane.benchmarks.views import _operator
from controlplane.catalog.models import PricePlan, ResolutionPolicy

GATE_FIELDS = ("tier_id", "eval_set_id", "tolerance_points", "max_tokens")
# A tier's fields that name another row: shown by that row's name.
NAMED = {"resolution_policy_id": ResolutionPolicy, "price_plan_id": PricePlan}


def _label(name: str) -> str:
    return name.removesuffix("_id").replace("_", " ")


def _shown(name: str, value):
    if name in NAMED and value is not None:
        found = NAMED[name].objects.filter(pk=value).first()
        return found.name if found else f"#{value} (deleted)"
    return "—" if value in (None, "") else value


@login_required
def gate_list(request):
    _operator(request)
    form = GateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        gate, created = QualityGate.objects.get_or_create(
            tier=form.cleaned_data["tier"], defaults={"eval_set": form.cleaned_data["eval_set"]})
        before = {} if created else field_values(gate, GATE_FIELDS)
        for name in ("eval_set", "tolerance_points", "max_tokens"):
            setattr(gate, name, form.cleaned_data[name])
        gate.save()
        audit_record(actor=request.user.get_username(),
                     action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                     obj=gate, before=before, after=field_values(gate, GATE_FIELDS))
        messages.success(request, f"{gate.tier.name}'s policy, model and engine changes are now checked on {gate.eval_set.name}.")
        return redirect("benchmarks:gates")
    return render(request, "benchmarks/gates.html", {
        "form": form, "gates": QualityGate.objects.select_related("tier", "eval_set").order_by("tier__name"),
        "checks": GateCheck.objects.select_related("policy", "tier", "requested_by")[:30]})


@login_required
@require_POST
def gate_delete(request, pk: int):
    _operator(request)
    gate = get_object_or_404(QualityGate, pk=pk)
    audit_record(actor=request.user.get_username(), action=AuditEntry.Action.DELETED, obj=gate,
                 before=field_values(gate, GATE_FIELDS))
    gate.delete()
    messages.success(request, f"{gate.tier.name}'s changes are no longer gated.")
    return redirect("benchmarks:gates")


@login_required
def check_detail(request, pk: int):
    _operator(request)
    check = get_object_or_404(GateCheck.objects.select_related("policy", "tier", "candidate", "requested_by",
                                                               "decided_by"), pk=pk)
    changed = [(_label(name), _shown(name, check.current.get(name)), _shown(name, value))
               for name, value in check.proposed.items() if check.current.get(name) != value]
    return render(request, "benchmarks/gate_check.html", {
        "check": check, "changed": changed, "override_form": OverrideForm(),
        "open": check.state not in GateCheck.DECIDED})


@login_required
@require_POST
def check_apply(request, pk: int):
    _operator(request)
    check = get_object_or_404(GateCheck, pk=pk)
    form = OverrideForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(e for errors in form.errors.values() for e in errors))
        return redirect("benchmarks:gate-check", pk=pk)
    try:
        changed = gates.check_apply(check=check, user=request.user, override_reason=form.cleaned_data["reason"])
    except gates.GateError as exc:
        messages.error(request, str(exc))
        return redirect("benchmarks:gate-check", pk=pk)
    messages.success(request, f"{'Policy' if check.policy_id else 'Tier'} {changed.name} changed.")
    return redirect("benchmarks:gate-check", pk=pk)


@login_required
@require_POST
def check_discard(request, pk: int):
    _operator(request)
    check = get_object_or_404(GateCheck, pk=pk)
    gates.check_discard(check=check, user=request.user)
    messages.success(request, f"The change was discarded; the {'policy' if check.policy_id else 'tier'} is as it was.")
    return redirect("benchmarks:gate-check", pk=pk)
