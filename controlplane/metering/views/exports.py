"""The Exports page: finance and operators pick a report, a period, a tenant and a file type,
and download it. The files themselves come from controlplane.metering.exports."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone

from controlplane.metering.exports import ExportError, export_for, export_response
from controlplane.metering.forms import FILETYPE_CHOICES, REPORT_CHOICES, ExportForm
from controlplane.tenants import roles


def _require_finance_or_operator(user):
    if not (roles.is_operator(user) or roles.is_finance(user)):
        raise PermissionDenied


def _download_url(report: str, filetype: str, query: dict) -> str:
    url = reverse("dashboard:export", kwargs={"report": report, "filetype": filetype})
    return f"{url}?{urlencode(query)}" if query else url


@login_required
def exports(request):
    _require_finance_or_operator(request.user)
    tenants = roles.visible_tenants(request.user)
    form = ExportForm(request.GET if "report" in request.GET else None, tenants=tenants)
    if form.is_bound and form.is_valid():
        return redirect(_download_url(form.cleaned_data["report"], form.cleaned_data["filetype"], form.query()))
    this_month = timezone.now().date().replace(day=1)
    last_month = (this_month - dt.timedelta(days=1)).replace(day=1)
    periods = [("This month so far", {"month": f"{this_month:%Y-%m}"}),
               ("Last month", {"month": f"{last_month:%Y-%m}"})]
    quick = [{"report": label, "period": period_label,
              "links": [(name, _download_url(report, filetype, query)) for filetype, name in FILETYPE_CHOICES]}
             for report, label in REPORT_CHOICES for period_label, query in periods]
    return render(request, "metering/exports.html", {"form": form, "quick": quick})


@login_required
def download(request, report: str, filetype: str):
    """A report as a file. ?month=YYYY-MM, or ?from=YYYY-MM-DD&to=YYYY-MM-DD; &tenant=NAME,
    &tier=NAME, &key=PREFIX"""
    _require_finance_or_operator(request.user)
    try:
        export = export_for(report=report, filetype=filetype, params=request.GET,
                            tenants=roles.visible_tenants(request.user), today=timezone.now().date())
    except ExportError as exc:
        if report not in dict(REPORT_CHOICES) or filetype not in dict(FILETYPE_CHOICES):
            raise Http404(str(exc)) from None
        # Plain text: the message quotes what was asked for, which must never run as a page.
        return HttpResponseBadRequest(str(exc), content_type="text/plain; charset=utf-8")
    return export_response(export, asgi=request.META.get("wsgi.version") is None)
