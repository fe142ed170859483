"""A tenant admin's own page: its keys (create with a model scope, revoke, last used, spend
this month), what is left of its quota, and its statements."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.catalog.routing import tenant_auto
from controlplane.metering.selectors import budget_terms, keys_budget, quota_use
from controlplane.tenants import roles
from controlplane.tenants.forms import OwnKeyForm
from controlplane.tenants.models import ApiKey, Quota
from controlplane.tenants.services import TenantInactive, api_key_create, api_key_revoke
from controlplane.tenants.views.keys import key_page, key_rotated


def _tenant(request):
    tenant = roles.member_tenant(request.user)
    if tenant is None:
        raise PermissionDenied
    return tenant


@login_required
def account(request):
    tenant = _tenant(request)
    form = OwnKeyForm(request.POST or None, tenant=tenant)
    if request.method == "POST" and form.is_valid():
        try:
            issued = api_key_create(tenant=tenant, name=form.cleaned_data["name"], created_by=request.user,
                                    expires_at=form.cleaned_data["expires_at"],
                                    tiers=list(form.cleaned_data["tiers"]),
                                    requests_per_minute=form.cleaned_data["requests_per_minute"],
                                    spend_limit=form.cleaned_data["spend_limit"])
        except TenantInactive as exc:  # deactivated as the form was sent
            form.add_error(None, str(exc))
        else:
            request.session["issued_key"] = issued.secret
            return redirect("dashboard:account")
    now = timezone.now()
    keys = list(ApiKey.objects.filter(tenant=tenant).select_related("tenant", "tenant__quota")
                .prefetch_related("allowed_tiers").order_by("-created_at"))
    budgets = keys_budget(keys, now=now)
    for key in keys:
        key.budget = budgets[key.pk]
    quota = Quota.objects.filter(tenant=tenant).first()
    period, _ = budget_terms(tenant)
    return render(request, "tenants/account.html", {
        "tenant": tenant, "form": form, "keys": keys, "issued": request.session.pop("issued_key", None),
        "quota": quota, "use": quota_use(tenant=tenant, quota=quota, now=now), "auto": tenant_auto(tenant),
        "budget_period": "today" if period == "day" else f"{now:%Y-%m}", "now": now,
    })


@login_required
@require_POST
def account_key_revoke(request, pk: int):
    tenant = _tenant(request)
    api_key = get_object_or_404(ApiKey, pk=pk, tenant=tenant)  # another tenant's key is not found
    api_key_revoke(api_key=api_key, actor=request.user)
    messages.success(request, f"Key {api_key.prefix}… revoked: requests with it are refused from now on.")
    return redirect("dashboard:account")


@login_required
def account_key_edit(request, pk: int):
    tenant = _tenant(request)
    api_key = get_object_or_404(ApiKey.objects.select_related("tenant", "tenant__quota"), pk=pk, tenant=tenant)
    return key_page(request, api_key, back=reverse("dashboard:account"),
                    rotate=reverse("dashboard:account-key-rotate", args=[pk]),
                    rules=f"{reverse('dashboard:account-rules')}?key={api_key.prefix}")


@login_required
@require_POST
def account_key_rotate(request, pk: int):
    tenant = _tenant(request)
    api_key = get_object_or_404(ApiKey, pk=pk, tenant=tenant)  # another tenant's key is not found
    return key_rotated(request, api_key, back=reverse("dashboard:account"))
