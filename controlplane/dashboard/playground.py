"""The playground: chat with a model, images included, from the browser, through the gateway
as a tenant's client would (so it is admitted, metered and billed like any request), without
pasting a key: the page gets a short-lived key of its own from the reader's session. An
operator's requests are metered to the service's own (internal) tenant, or to a tenant the
operator picks; a tenant admin's to their tenant. Before sending it shows what the policy
makes of each image and what the request may cost; it keeps the conversation, compares two
models on the same input, and shows the exact request as curl and Python."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.tenants import roles
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.services import TenantInactive, api_key_create, internal_tenant

KEY_LIFETIME = dt.timedelta(hours=1)
KEY_RENEW_BEFORE = dt.timedelta(minutes=5)  # a key this close to expiring is replaced
SESSION_KEY = "playground_keys"  # tenant name -> {"secret", "id", "expires"}


def _tenants(user) -> list[Tenant]:
    """Whose the reader's playground requests may be: an operator's, the internal tenant's
    (first) or any active tenant's; finance's, the internal tenant's; a tenant admin's, their
    own tenant's."""
    if roles.is_operator(user):
        internal = internal_tenant()
        return [internal, *Tenant.objects.filter(active=True, internal=False).order_by("name")]
    if roles.is_finance(user):
        return [internal_tenant()]
    tenant = roles.member_tenant(user)
    return [tenant] if tenant is not None else []


@login_required
def playground(request):
    if not roles.can_see_usage(request.user):
        raise PermissionDenied
    return render(request, "dashboard/playground.html", {"tenants": _tenants(request.user)})


@login_required
@require_POST
def playground_key(request):
    """A key for the page's requests, for the tenant asked (by name) if the reader may use it:
    made once an hour per tenant and kept in the server-side session, never shown anywhere
    else. JSON: {key, tenant, expires_at}."""
    if not roles.can_see_usage(request.user):
        raise PermissionDenied
    tenants = {tenant.name: tenant for tenant in _tenants(request.user)}
    tenant = tenants.get(request.POST.get("tenant") or next(iter(tenants), ""))
    if tenant is None:
        return JsonResponse({"error": "no such tenant for your playground"}, status=400)
    now = timezone.now()
    kept = request.session.get(SESSION_KEY, {})
    held = kept.get(tenant.name)
    if held and dt.datetime.fromisoformat(held["expires"]) - KEY_RENEW_BEFORE > now and ApiKey.objects.filter(
            pk=held["id"], revoked_at__isnull=True).exists():
        return JsonResponse({"key": held["secret"], "tenant": tenant.name, "expires_at": held["expires"]})
    try:
        issued = api_key_create(tenant=tenant, name=f"playground of {request.user.get_username()}"[:64],
                                created_by=request.user, expires_at=now + KEY_LIFETIME)
    except TenantInactive as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    expires = issued.api_key.expires_at.isoformat()
    kept[tenant.name] = {"secret": issued.secret, "id": issued.api_key.pk, "expires": expires}
    request.session[SESSION_KEY] = kept
    return JsonResponse({"key": issued.secret, "tenant": tenant.name, "expires_at": expires})
