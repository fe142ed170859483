from __future__ import annotations

import datetime as dt

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.dashboard.charts import image_tokens_chart
from controlplane.dashboard.forms import ApiKeyForm
from controlplane.dashboard.selectors import image_tokens_per_day, usage_totals
from controlplane.fleet.models import EngineEvent, EngineInstance
from controlplane.tenants import roles
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_create, api_key_revoke


def _require(check, user):
    if not check(user):
        raise PermissionDenied


@login_required
def index(request):
    _require(roles.can_see_usage, request.user)
    tenants = roles.visible_tenants(request.user)
    since = timezone.now().date() - dt.timedelta(days=30)
    series = image_tokens_per_day(tenants=tenants, since=since)
    return render(request, "dashboard/index.html", {
        "chart": image_tokens_chart(series),
        "has_data": bool(series),
        "totals": usage_totals(tenants=tenants, since=since),
        "tenants": tenants,
    })


@login_required
def keys(request):
    _require(roles.is_operator, request.user)
    form = ApiKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        result = api_key_create(tenant=form.cleaned_data["tenant"], name=form.cleaned_data["name"],
                                created_by=request.user, expires_at=form.cleaned_data["expires_at"])
        # Post/redirect/get: a reload must not mint a second key. The secret rides in the
        # server-side session only until the next page view, which removes it.
        request.session["issued_key"] = result.secret
        return redirect("dashboard:keys")
    return render(request, "dashboard/keys.html", {
        "form": form, "issued": request.session.pop("issued_key", None),
        "keys": ApiKey.objects.select_related("tenant").order_by("tenant__name", "-created_at"),
    })


@login_required
@require_POST
def key_revoke(request, pk: int):
    _require(roles.is_operator, request.user)
    api_key = get_object_or_404(ApiKey, pk=pk)
    api_key_revoke(api_key=api_key)
    messages.success(request, f"Key {api_key.prefix}… revoked.")
    return redirect("dashboard:keys")


@login_required
def fleet(request):
    _require(roles.is_operator, request.user)
    return render(request, "dashboard/fleet.html", {
        "instances": EngineInstance.objects.select_related("tier", "node").order_by("tier__name", "id"),
        "events": EngineEvent.objects.select_related("instance__tier")[:30],
    })
