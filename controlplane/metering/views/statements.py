"""Monthly statements as a page: per tenant and month, the same figures as the API's
/api/v1/statements/ (one function makes both), for finance and operators, and for a tenant
admin their own tenant's."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from django.utils import timezone

from controlplane.metering.periods import month_bounds, month_of
from controlplane.metering.statements import statement
from controlplane.tenants import roles


@login_required
def statements(request):
    """?tenant=NAME (staff) and ?month=YYYY-MM (this month when absent)."""
    if not roles.can_see_usage(request.user):
        raise PermissionDenied
    staff = roles.is_operator(request.user) or roles.is_finance(request.user)
    tenants = list(roles.visible_tenants(request.user).order_by("name"))
    wanted = request.GET.get("tenant") if staff else None
    tenant = next((t for t in tenants if t.name == wanted), None) if staff else roles.member_tenant(request.user)
    now, error = timezone.now(), ""
    month_text = request.GET.get("month") or f"{now:%Y-%m}"
    try:
        year, month = month_of(month_text)
    except ValueError as exc:
        error, (year, month) = f"{month_text!r}: {exc}", (now.year, now.month)
    found = statement(tenant=tenant, year=year, month=month) if tenant is not None else None
    start, end = month_bounds(year, month)
    return render(request, "metering/statements.html", {
        "tenants": tenants, "tenant": tenant, "staff": staff, "month": f"{year:04d}-{month:02d}", "error": error,
        "statement": found, "first_day": start.date(), "last_day": (end - dt.timedelta(days=1)).date(),
    })
