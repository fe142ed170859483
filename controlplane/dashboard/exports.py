"""The Exports page: finance and operators pick a report, a period, a tenant and a file type,
and download it. The files themselves come from controlplane.metering.exports."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlencode

from django import forms
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone

from controlplane.metering.exports import (
    CSV,
    IMAGES,
    MONTHLY_SUMMARY,
    XLSX,
    ExportError,
    export_for,
    export_response,
    period_from,
)
from controlplane.tenants import roles

REPORT_CHOICES = [(IMAGES, "Per-image cost report"), (MONTHLY_SUMMARY, "Monthly summary per tenant")]
FILETYPE_CHOICES = [(CSV, "CSV"), (XLSX, "XLSX (Excel)")]


def _require_finance_or_operator(user):
    if not (roles.is_operator(user) or roles.is_finance(user)):
        raise PermissionDenied


class ExportForm(forms.Form):
    report = forms.ChoiceField(choices=REPORT_CHOICES, initial=IMAGES)
    month = forms.CharField(required=False, widget=forms.TextInput(attrs={"type": "month", "placeholder": "YYYY-MM"}),
                            help_text="A month, or leave empty and give dates")
    start = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(required=False, label="To", widget=forms.DateInput(attrs={"type": "date"}))
    tenant = forms.ModelChoiceField(queryset=None, required=False, to_field_name="name", empty_label="Every tenant")
    filetype = forms.ChoiceField(choices=FILETYPE_CHOICES, initial=CSV, label="File type", widget=forms.RadioSelect)

    def __init__(self, *args, tenants, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants

    def clean(self):
        data = super().clean()
        try:
            period_from(self.query(), today=timezone.now().date())
        except ExportError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data

    def query(self) -> dict[str, str]:
        """The download's query string parameters."""
        data = self.cleaned_data
        query = {"month": data.get("month") or ""}
        if not query["month"]:
            query = {"from": data["start"].isoformat() if data.get("start") else "",
                     "to": data["end"].isoformat() if data.get("end") else ""}
        if data.get("tenant"):
            query["tenant"] = data["tenant"].name
        return {key: value for key, value in query.items() if value}


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
    return render(request, "dashboard/exports.html", {"form": form, "quick": quick})


@login_required
def download(request, report: str, filetype: str):
    """A report as a file. ?month=YYYY-MM, or ?from=YYYY-MM-DD&to=YYYY-MM-DD; &tenant=NAME"""
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
