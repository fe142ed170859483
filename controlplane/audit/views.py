"""The audit log: who changed what and when, filterable, newest first."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import render
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.web.access import staff_only

PAGE_SIZE = 50


def _day(text: str | None) -> dt.date | None:
    try:
        return dt.date.fromisoformat(text) if text else None
    except ValueError:
        return None


@login_required
def audit_log(request):
    """?type=, ?actor=, ?q= (in the object's name), ?from= and ?to= (days, inclusive), ?page=."""
    staff_only(request)
    entries = AuditEntry.objects.all()
    chosen = {name: (request.GET.get(name) or "").strip()[:150] for name in ("type", "actor", "q", "from", "to")}
    if chosen["type"]:
        entries = entries.filter(object_type=chosen["type"])
    if chosen["actor"]:
        entries = entries.filter(actor=chosen["actor"])
    if chosen["q"]:
        entries = entries.filter(object_repr__icontains=chosen["q"])
    zone = timezone.get_current_timezone()
    start, end = _day(chosen["from"]), _day(chosen["to"])
    if start:
        entries = entries.filter(at__gte=dt.datetime.combine(start, dt.time(), zone))
    if end:  # to its last instant, not the next midnight: there is none after 9999-12-31
        entries = entries.filter(at__lte=dt.datetime.combine(end, dt.time.max, zone))
    page = Paginator(entries, PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "audit/audit.html", {
        "page": page, "chosen": chosen, "query": query.urlencode(),
        "types": AuditEntry.objects.order_by("object_type").values_list("object_type", flat=True).distinct(),
        "actors": AuditEntry.objects.order_by("actor").values_list("actor", flat=True).distinct(),
    })
