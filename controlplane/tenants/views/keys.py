"""API keys for operators: issue one for any tenant (its secret shown once), see every key
with its tenant's `auto` routes, revoke one."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane.catalog.models import ModelTier
from controlplane.catalog.routing import tenant_auto
from controlplane.metering.selectors import budget_terms, keys_spend
from controlplane.tenants.forms import ApiKeyForm
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import TenantInactive, api_key_create, api_key_revoke
from controlplane.web.access import operators_only


@login_required
def keys(request):
    operators_only(request)
    form = ApiKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            result = api_key_create(tenant=form.cleaned_data["tenant"], name=form.cleaned_data["name"],
                                    created_by=request.user, expires_at=form.cleaned_data["expires_at"],
                                    tiers=list(form.cleaned_data["tiers"]),
                                    requests_per_minute=form.cleaned_data["requests_per_minute"],
                                    spend_limit=form.cleaned_data["spend_limit"])
        except TenantInactive as exc:  # deactivated as the form was sent
            form.add_error("tenant", str(exc))
        else:
            # Post/redirect/get: a reload must not mint a second key. The secret rides in the
            # server-side session only until the next page view, which removes it.
            request.session["issued_key"] = result.secret
            return redirect("dashboard:keys")

    keys = list(ApiKey.objects.select_related("tenant", "tenant__quota").prefetch_related("tenant__allowed_tiers")
                .order_by("tenant__name", "-created_at"))
    spend = keys_spend(keys)
    enabled, routes = list(ModelTier.objects.filter(enabled=True)), {}
    for key in keys:
        if key.tenant_id not in routes:
            routes[key.tenant_id] = tenant_auto(key.tenant, enabled_tiers=enabled)
        key.auto = routes[key.tenant_id]
        key.spend, (_, key.currency) = spend.get(key.pk, 0), budget_terms(key.tenant)
    return render(request, "tenants/keys.html", {
        "form": form, "issued": request.session.pop("issued_key", None), "keys": keys,
    })


@login_required
@require_POST
def key_revoke(request, pk: int):
    operators_only(request)
    api_key = get_object_or_404(ApiKey, pk=pk)
    api_key_revoke(api_key=api_key, actor=request.user)
    messages.success(request, f"Key {api_key.prefix}… revoked.")
    return redirect("dashboard:keys")
