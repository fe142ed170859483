"""API keys for operators: issue one for any tenant (its secret shown once), see every key
with its tenant's `auto` routes, revoke one."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from controlplane.catalog.models import ModelTier
from controlplane.catalog.routing import tenant_auto
from controlplane.metering.selectors import keys_budget
from controlplane.tenants import roles
from controlplane.tenants.forms import ApiKeyForm, OwnKeyForm
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import (
    KeyRevoked,
    TenantInactive,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    api_key_update,
)
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
    budgets = keys_budget(keys)
    enabled, routes = list(ModelTier.objects.filter(enabled=True)), {}
    for key in keys:
        if key.tenant_id not in routes:
            routes[key.tenant_id] = tenant_auto(key.tenant, enabled_tiers=enabled)
        key.auto = routes[key.tenant_id]
        key.budget = budgets[key.pk]
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


def key_page(request, api_key: ApiKey, *, back: str, rotate: str, rules: str):
    """A key's own page: edit its name, models, limits, budget and expiry; rotate its secret.
    `back`: the keys list it belongs to (the operator's or the tenant admin's); `rules`: the
    routing rules its requests read."""
    form = OwnKeyForm(request.POST or None, tenant=api_key.tenant, capture=roles.is_operator(request.user), initial={
        "name": api_key.name, "tiers": list(api_key.allowed_tiers.all()), "expires_at": api_key.expires_at,
        "requests_per_minute": api_key.requests_per_minute, "spend_limit": api_key.spend_limit,
        "capture_bodies": api_key.capture_bodies})
    if request.method == "POST" and form.is_valid():
        try:
            api_key_update(api_key=api_key, values=form.cleaned_data, tiers=list(form.cleaned_data["tiers"]),
                           actor=request.user)
        except KeyRevoked as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Key {api_key.prefix}… saved: the gateway applies it within seconds.")
            return redirect(back)
    return render(request, "tenants/key_form.html", {
        "form": form, "key": api_key, "back": back, "rotate": rotate, "rules": rules,
        "budget": keys_budget([api_key])[api_key.pk]})


def key_rotated(request, api_key: ApiKey, *, back: str):
    """Rotate a key and show its new secret once, on the list it belongs to."""
    try:
        issued = api_key_rotate(api_key=api_key, actor=request.user)
    except (KeyRevoked, TenantInactive) as exc:
        messages.error(request, str(exc))
    else:
        request.session["issued_key"] = issued.secret
        messages.success(request, f"Key {api_key.name or api_key.prefix} has a new secret: the old one stops "
                                  "working within seconds.")
    return redirect(back)


@login_required
def key_edit(request, pk: int):
    operators_only(request)
    api_key = get_object_or_404(ApiKey.objects.select_related("tenant", "tenant__quota"), pk=pk)
    return key_page(request, api_key, back=reverse("dashboard:keys"), rotate=reverse("dashboard:key-rotate", args=[pk]),
                    rules=f"{reverse('dashboard:tenant-rules', args=[api_key.tenant.name])}?key={api_key.prefix}")


@login_required
@require_POST
def key_rotate(request, pk: int):
    operators_only(request)
    return key_rotated(request, get_object_or_404(ApiKey, pk=pk), back=reverse("dashboard:keys"))
