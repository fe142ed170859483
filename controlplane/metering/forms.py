"""The forms of the metering pages: the request log's filters and the exports' choices."""

from __future__ import annotations

from django import forms
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.metering.exports import (
    CSV,
    IMAGES,
    MONTHLY_SUMMARY,
    XLSX,
    ExportError,
    period_from,
)
from controlplane.metering.models import UsageEvent
from controlplane.metering.selectors import LogQuery
from controlplane.tenants.models import ApiKey
from controlplane.web.fields import UtcDateTimeField

FAILED = "failed"
REPORT_CHOICES = [(IMAGES, "Per-image cost report"), (MONTHLY_SUMMARY, "Monthly summary per tenant")]
FILETYPE_CHOICES = [(CSV, "CSV"), (XLSX, "XLSX (Excel)")]


class LogFilterForm(forms.Form):
    q = forms.CharField(required=False, max_length=64, label="Request id")
    tenant = forms.ChoiceField(required=False)
    key = forms.CharField(required=False, max_length=16, label="Key prefix")
    tier = forms.ChoiceField(required=False, label="Model")
    status = forms.ChoiceField(required=False, choices=[
        ("", "any"), (FAILED, "not ok (error, aborted, interrupted)"), *UsageEvent.Status.choices])
    latency_min = forms.IntegerField(required=False, min_value=0, max_value=10**8, label="Latency from (ms)")
    latency_max = forms.IntegerField(required=False, min_value=0, max_value=10**8, label="to (ms)")
    since = UtcDateTimeField(required=False, label="From", widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    until = UtcDateTimeField(required=False, label="Until", widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))

    def __init__(self, *args, tenants, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenants = {tenant.name: tenant for tenant in tenants}
        self.fields["tenant"].choices = [("", "every tenant"), *((name, name) for name in self.tenants)]
        self.tier_ids = dict(ModelTier.objects.order_by("name").values_list("name", "pk"))
        self.fields["tier"].choices = [("", "every model"), *((name, name) for name in self.tier_ids)]

    def clean_q(self):
        return self.cleaned_data["q"].strip()

    def clean(self):
        data = super().clean()
        low, high = data.get("latency_min"), data.get("latency_max")
        if low is not None and high is not None and low > high:
            self.add_error("latency_max", "must not be below the latency it starts from")
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            self.add_error("until", "must be after From")
        return data

    def query(self, *, every_tenant: bool) -> LogQuery:
        """`every_tenant`: the reader may see them all, so no tenant chosen means no filter."""
        data = self.cleaned_data if self.is_bound else {name: None for name in self.fields}
        tenant = self.tenants.get(data["tenant"] or "")
        visible = tuple(t.pk for t in self.tenants.values())
        tenant_ids = (tenant.pk,) if tenant else None if every_tenant else visible
        key_id = None
        if data["key"]:
            key = ApiKey.objects.filter(prefix=data["key"].strip(), tenant_id__in=tenant_ids or visible).first()
            key_id = key.pk if key else -1  # a prefix nobody may see matches nothing
        tier_id = self.tier_ids.get(data["tier"] or "")
        status = data["status"] or ""
        return LogQuery(
            tenant_ids=tenant_ids, api_key_id=key_id, tier_id=tier_id,
            statuses=(status,) if status and status != FAILED else (), failed_only=status == FAILED,
            latency_min_ms=data["latency_min"], latency_max_ms=data["latency_max"],
            since=data["since"], until=data["until"], request_id=data["q"] or "",
        )


class ExportForm(forms.Form):
    report = forms.ChoiceField(choices=REPORT_CHOICES, initial=IMAGES)
    month = forms.CharField(required=False, widget=forms.TextInput(attrs={"type": "month", "placeholder": "YYYY-MM"}),
                            help_text="A month, or leave empty and give dates")
    start = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(required=False, label="To", widget=forms.DateInput(attrs={"type": "date"}))
    tenant = forms.ModelChoiceField(queryset=None, required=False, to_field_name="name", empty_label="Every tenant")
    internal = forms.BooleanField(required=False, label="With the service's own traffic",
                                  help_text="Benchmark runs through the gateway and the playground, left out "
                                            "of every tenant's totals unless ticked")
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
        elif data.get("internal"):
            query["internal"] = "1"
        return {key: value for key, value in query.items() if value}
