"""The request log: every request the gateway answered, newest first, filtered and paged by
key; and one request opened, with its images, tokens, cost, engine and timings.

Operators and finance see every tenant; a tenant's admin sees their own tenant only."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import render

from controlplane.metering.forms import LogFilterForm
from controlplane.metering.models import RequestCapture, UsageEvent
from controlplane.metering.records import ESCALATIONS
from controlplane.metering.selectors import (
    LogCursor,
    cascade_attempts,
    usage_event_detail,
    usage_log,
)
from controlplane.tenants import roles

PAGE_SIZE = 50
# Why a cascade's first answer was not the one sent.
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
    return render(request, "metering/requests.html", {
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
    # Its body and answer, when its tenant or key captured them: for operators alone.
    captured = RequestCapture.objects.filter(request_id=request_id).first() if roles.is_operator(request.user) \
        else None
    return render(request, "metering/request.html", {
        "event": event, "timings": _timings(event), "pictures": _pictures(event.image_rows),
        "recorded_after": event.recorded_at - event.created_at, "image_failure": _image_failure(event),
        "captured": captured, "captured_messages": _captured_messages(captured),
        "retention_hours": settings.CAPTURE_RETENTION_HOURS, "cascade": _cascade(event),
    })


def _cascade(event: UsageEvent):
    """Its cascade's two attempts, the first saying in words why it was escalated."""
    attempts = cascade_attempts(event)
    if attempts is not None and attempts[0] is not None:
        first = attempts[0]
        first.escalation_reason = ESCALATIONS.get(first.escalation, first.escalation)
    return attempts


def _captured_messages(captured) -> list[dict]:
    """A captured body's messages as the page shows them: each with its role and its parts,
    text or a thumbnail."""
    if captured is None:
        return []
    shown = []
    for message in captured.request.get("messages") or []:
        content = message.get("content")
        parts = [{"text": content}] if isinstance(content, str) else []
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "text":
                parts.append({"text": part.get("text", "")})
            else:
                spec = part.get(part.get("type"))
                url = spec.get("url") if isinstance(spec, dict) else spec
                parts.append({"image": url if isinstance(url, str) and url.startswith("data:image/jpeg") else None,
                              "text": "" if isinstance(url, str) and url.startswith("data:") else str(url)})
        shown.append({"role": message.get("role"), "parts": parts})
    return shown


def _image_failure(event: UsageEvent) -> str | None:
    """Why its images were refused, when that is why it failed (the gateway names the image:
    "image 2: ...")."""
    if event.error_stage == "intake" and event.error_message.startswith("image "):
        return event.error_message
    return None


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
