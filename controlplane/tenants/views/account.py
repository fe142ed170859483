"""A tenant admin's own page: its keys (create with a model scope, revoke, last used, spend
this month), what is left of its quota, and its statements."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Sum
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.catalog.routing import tenant_auto
from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import period_start
from controlplane.metering.selectors import quota_use
from controlplane.tenants import roles
from controlplane.tenants.forms import OwnKeyForm
from controlplane.tenants.models import ApiKey, Quota
from controlplane.tenants.services import TenantInactive, api_key_create, api_key_revoke


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
                                    requests_per_minute=form.cleaned_data["requests_per_minute"])
        except TenantInactive as exc:  # deactivated as the form was sent
            form.add_error(None, str(exc))
        else:
            request.session["issued_key"] = issued.secret
            return redirect("dashboard:account")
    now = timezone.now()
    month = period_start("month", now)
    spend = dict(UsageEvent.objects.filter(tenant=tenant, created_at__gte=month).values("api_key_id")
                 .annotate(cost=Sum("cost")).values_list("api_key_id", "cost"))
    keys = list(ApiKey.objects.filter(tenant=tenant).prefetch_related("allowed_tiers").order_by("-created_at"))
    for key in keys:
        key.spend = spend.get(key.pk) or 0
    quota = Quota.objects.filter(tenant=tenant).first()
    return render(request, "tenants/account.html", {
        "tenant": tenant, "form": form, "keys": keys, "issued": request.session.pop("issued_key", None),
        "quota": quota, "use": quota_use(tenant=tenant, quota=quota, now=now), "auto": tenant_auto(tenant), "month": f"{now:%Y-%m}", "now": now,
    })


@login_required
@require_POST
def account_key_revoke(request, pk: int):
    tenant = _tenant(request)
    api_key = get_object_or_404(ApiKey, pk=pk, tenant=tenant)  # another tenant's key is not found
    api_key_revoke(api_key=api_key, actor=request.user)
    messages.success(request, f"Key {api_key.prefix}… revoked: requests with it are refused from now on.")
    return redirect("dashboard:account")
