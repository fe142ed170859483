"""Tenant pages for operators: the list with each tenant's quota use, a form to create or edit
a tenant (its tiers, `auto` defaults and quota, beside what it has used), and the quota new
tenants start with."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render

from controlplane.audit.services import history
from controlplane.metering.selectors import quota_use, quotas_use
from controlplane.tenants.forms import QUOTA_LIMITS, QuotaDefaultForm, TenantForm
from controlplane.tenants.models import Quota, QuotaDefault, Tenant
from controlplane.tenants.services import quota_default_set, tenant_save
from controlplane.web.access import operators_only


@login_required
def tenant_list(request):
    operators_only(request)
    tenants = list(Tenant.objects.prefetch_related("allowed_tiers").select_related("quota").order_by("name"))
    use = quotas_use(tenants)
    for tenant in tenants:
        tenant.use = use[tenant.pk]
    defaults = QuotaDefault.current()
    form = QuotaDefaultForm(request.POST or None, instance=defaults)
    if request.method == "POST" and form.is_valid():
        quota_default_set(values=form.cleaned_data, actor=request.user.get_username())
        messages.success(request, "New tenants now start with this quota.")
        return redirect("dashboard:tenants")
    return render(request, "tenants/tenants.html", {"tenants": tenants, "defaults_form": form,
                                                      "defaults": defaults})


@login_required
def tenant_new(request):
    operators_only(request)
    return _tenant_form(request, Tenant())


@login_required
def tenant_edit(request, name):
    operators_only(request)
    return _tenant_form(request, get_object_or_404(Tenant, name=name))


def _tenant_form(request, tenant: Tenant):
    creating = tenant.pk is None
    form = TenantForm(request.POST or None, instance=tenant)
    if request.method == "POST" and form.is_valid():
        tenant = tenant_save(tenant=form.save(commit=False), tiers=form.chosen_tiers(), quota=form.quota(),
                             actor=request.user.get_username())
        messages.success(request, f"Tenant {tenant.name} {'created' if creating else 'saved'}.")
        return redirect("dashboard:tenant-edit", name=tenant.name)
    quota = None if creating else Quota.objects.filter(tenant=tenant).first()
    use = {row["name"]: row for row in quota_use(tenant=tenant, quota=quota)} if not creating else {}
    return render(request, "tenants/tenant_form.html", {
        "form": form, "tenant": tenant, "creating": creating,
        "tenant_fields": [form[name] for name in TenantForm.Meta.fields],
        "limit_rows": [(form[name], use.get(name)) for name in QUOTA_LIMITS],
        "history": [] if creating else _history(tenant, quota),
    })


def _history(tenant: Tenant, quota: Quota | None) -> list:
    entries = list(history(tenant)[:20]) + (list(history(quota)[:20]) if quota else [])
    return sorted(entries, key=lambda e: e.at, reverse=True)[:20]
