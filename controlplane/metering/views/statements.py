"""Monthly statements as a page: per tenant and month, the same figures as the API's
/api/v1/statements/ (one function makes both), for finance and operators, and for a tenant
admin their own tenant's; every tenant's month on one page for finance and operators; and
each tenant's month as a PDF invoice."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from controlplane.metering.invoices import invoice_number, invoice_pdf
from controlplane.metering.periods import month_bounds, month_of
from controlplane.metering.statements import month_statements, statement
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
    if wanted and tenant is None:
        error = f"no tenant {wanted!r} you can see"
    found = statement(tenant=tenant, year=year, month=month) if tenant is not None else None
    every = month_statements(tenants=tenants, year=year, month=month) if staff and not wanted else None
    start, end = month_bounds(year, month)
    return render(request, "metering/statements.html", {
        "tenants": tenants, "tenant": tenant, "staff": staff, "month": f"{year:04d}-{month:02d}", "error": error,
        "statement": found, "every": every, "first_day": start.date(), "last_day": (end - dt.timedelta(days=1)).date(),
    }, status=400 if error else 200)


@login_required
def invoice(request, tenant: str, month: str):
    """A tenant's month as a PDF invoice: any tenant's for finance and operators, a tenant
    admin's own."""
    if not roles.can_see_usage(request.user):
        raise PermissionDenied
    found = roles.visible_tenants(request.user).filter(name=tenant).first()
    try:
        year, number = month_of(month)
    except ValueError:
        raise Http404(f"no month {month!r}") from None
    if found is None:
        raise Http404(f"no tenant {tenant!r} you can see")
    bill = statement(tenant=found, year=year, month=number)
    response = HttpResponse(invoice_pdf(bill, display_name=found.display_name, issued=timezone.now().date()),
                            content_type="application/pdf")
    response["Content-Disposition"] = f'attachment; filename="invoice-{invoice_number(bill)}.pdf"'
    return response
