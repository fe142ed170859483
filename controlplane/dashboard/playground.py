"""The playground: chat with a model, image included, from the browser, through the gateway
with one of the reader's API keys, as a tenant's client would (so it is admitted, metered and
billed like any request). Before sending it shows what the policy makes of the image and what
that costs; after the answer, the usage the gateway metered and its recorded cost."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render

from controlplane.tenants import roles


@login_required
def playground(request):
    if not roles.can_see_usage(request.user):
        raise PermissionDenied
    return render(request, "dashboard/playground.html", {})
