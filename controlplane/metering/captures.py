"""Captured request and response bodies (metering.models.RequestCapture) are deleted once
older than CAPTURE_RETENTION_HOURS."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.utils import timezone

from controlplane.metering.models import RequestCapture


def captures_prune(*, now: dt.datetime | None = None) -> int:
    """Delete the captures past their retention; how many."""
    before = (now or timezone.now()) - dt.timedelta(hours=settings.CAPTURE_RETENTION_HOURS)
    return RequestCapture.objects.filter(created_at__lt=before).delete()[0]
