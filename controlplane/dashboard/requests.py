"""The request log: every request the gateway answered, newest first, filtered and paged by
key; and one request opened, with its images, tokens, cost, engine and timings.

Operators and finance see every tenant; a tenant's admin sees their own tenant only."""

from __future__ import annotations

from django import forms
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import render

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import UsageEvent
from controlplane.metering.selectors import LogCursor, LogQuery, usage_event_detail, usage_log
from controlplane.tenants import roles
from controlplane.tenants.models import ApiKey
from controlplane.web.fields import UtcDateTimeField

PAGE_SIZE = 50
FAILED = "failed"


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


def _visible(user) -> list:
    if not roles.can_see_usage(user):
        raise PermissionDenied
    return list(roles.visible_tenants(user).order_by("name"))


@login_required
def request_log(request):
    tenants = _visible(request.user)
    form = LogFilterForm(request.GET or None, tenants=tenants)
    events, following = [], None
    if not form.is_bound or form.is_valid():
        events, following = usage_log(form.query(every_tenant=roles.sees_every_tenant(request.user)),
                                      after=LogCursor.decode(request.GET.get("after")), limit=PAGE_SIZE)
    params = request.GET.copy()
    params.pop("after", None)
    return render(request, "dashboard/requests.html", {
        "form": form, "events": events, "filters": params.urlencode(),
        "next": following.encode() if following else None, "paged": "after" in request.GET,
        "every_tenant": len(tenants) > 1,
    })


@login_required
def request_detail(request, request_id: str):
    tenants = _visible(request.user)
    tenant_ids = None if roles.sees_every_tenant(request.user) else tuple(t.pk for t in tenants)
    event = usage_event_detail(request_id=request_id, tenant_ids=tenant_ids)
    if event is None:
        raise Http404("no such request")
    return render(request, "dashboard/request.html", {
        "event": event, "timings": _timings(event), "pictures": _pictures(event.image_rows),
        "recorded_after": event.recorded_at - event.created_at,
    })


def _timings(event: UsageEvent) -> list[tuple[str, int | None, str]]:
    """Each phase of the request's time, in the order it happened."""
    engine = None
    if event.prepare_ms is not None and event.queue_ms is not None:
        engine = max(0, event.latency_ms - event.prepare_ms - event.queue_ms)
    return [
        ("Image preparation", event.prepare_ms, "decoding, resizing and counting its images"),
        ("Queue", event.queue_ms, "admission and waiting for a turn before an engine was sent it"),
        ("Time to first token", event.ttft_ms,
         "from arrival to the first token streamed" if event.stream else "not streamed"),
        ("Engine", engine, "from being sent to the engine to the answer's last byte"),
        ("Total", event.latency_ms, "from arrival at the gateway to the answer's last byte"),
    ]


def _pictures(rows: list) -> list[dict]:
    """The images as the client sent them: a long picture cut into tiles is one picture."""
    pictures: list[dict] = []
    for row in rows:
        if row.tile == 0 or not pictures:
            pictures.append({"source": row, "parts": [], "tokens": 0, "cached_tokens": 0})
        picture = pictures[-1]
        picture["parts"].append(row)
        picture["tokens"] += row.tokens
        picture["cached_tokens"] += row.cached_tokens
    return pictures
