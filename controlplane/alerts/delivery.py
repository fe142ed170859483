"""Posting alerts to webhooks. A delivery row is claimed (its next attempt pushed past the
time a post can take), posted outside any transaction, then marked delivered, scheduled for
another attempt with exponential backoff, or given up. Whoever finds a row claimed or not due
leaves it alone, so the first send, the sweep and a duplicate task never post it twice at once;
a worker that dies mid-post leaves the row to the sweep once its claim runs out."""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane import outbound
from controlplane.alerts import slack
from controlplane.alerts.models import AlertDelivery, Webhook

log = logging.getLogger(__name__)

TIMEOUT_S = 10
MAX_ATTEMPTS = 8  # 10 s doubling to 10 min between them: about 20 minutes of trying
BACKOFF_BASE_S, BACKOFF_CAP_S = 10, 600
CLAIM_S = 3 * TIMEOUT_S  # a post takes at most TIMEOUT_S per phase; the claim outlasts it


@dataclass(frozen=True)
class Outcome:
    delivered: bool
    retry: bool = False  # worth trying again (the receiver or the network, not the request)
    retry_after: int | None = None
    error: str = ""
    status: int | None = None  # the receiver's HTTP status, when it answered
    elapsed_ms: int = 0

    @property
    def summary(self) -> str:
        """How the post went, for the operator: the answer's status (never its body) and time."""
        if self.status is None:
            return f"{self.error} after {self.elapsed_ms} ms"
        return f"{_status_line(self.status)} {'in' if self.delivered else 'after'} {self.elapsed_ms} ms"


def _status_line(status: int) -> str:
    # The status's standard phrase, not the receiver's: nothing it wrote is echoed back.
    return f"HTTP {status} {httpx.codes.get_reason_phrase(status)}".rstrip()


def backoff(attempts: int) -> int:
    """Seconds before attempt number `attempts` + 1."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))


def post(*, url: str, payload: dict) -> Outcome:
    """Post `payload` as JSON; never raises. 5xx, 408, 429, timeouts and connection errors are
    worth retrying; any other answer (a 404 for a deleted Slack webhook, say) will not change,
    nor will a URL this server may not call (controlplane/outbound.py)."""
    started = time.monotonic()

    def took() -> int:
        return round((time.monotonic() - started) * 1000)

    try:
        with outbound.client(trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS, what="webhook URL",
                             timeout=TIMEOUT_S, headers={"User-Agent": "vlm-controlplane-alerts"}) as client:
            response = client.post(url, json=payload)
    except outbound.RefusedTarget as exc:
        return Outcome(False, error=f"not sent: {exc}"[:500], elapsed_ms=took())
    except httpx.TimeoutException as exc:
        return Outcome(False, retry=True, error=f"timed out after {TIMEOUT_S} s ({type(exc).__name__})",
                       elapsed_ms=took())
    except httpx.TransportError as exc:
        return Outcome(False, retry=True, error=f"{type(exc).__name__}: {exc}"[:500], elapsed_ms=took())
    except (httpx.HTTPError, ValueError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}"[:500], elapsed_ms=took())
    status = response.status_code
    if 200 <= status < 300:
        return Outcome(True, status=status, elapsed_ms=took())
    retry = status >= 500 or status in (408, 429)
    return Outcome(False, retry=retry, retry_after=_retry_after(response), error=_status_line(status),
                   status=status, elapsed_ms=took())


def _retry_after(response: httpx.Response) -> int | None:
    try:
        seconds = int(response.headers.get("Retry-After", ""))
    except ValueError:
        return None  # absent, or an HTTP date: back off as usual
    return seconds if 0 <= seconds <= BACKOFF_CAP_S else None


def delivery_attempt(*, delivery_id: int, now: dt.datetime | None = None) -> str | None:
    """One attempt at a pending delivery that is due; returns its state after, or None when it
    was not this caller's to send (delivered, given up, claimed by another, or not due)."""
    now = now or timezone.now()
    with transaction.atomic():
        delivery = (AlertDelivery.objects.select_for_update(skip_locked=True, of=("self",)).select_related("webhook")
                    .filter(pk=delivery_id, state=AlertDelivery.State.PENDING, next_attempt_at__lte=now).first())
        if delivery is None:
            return None
        if not delivery.webhook.enabled:
            delivery.state, delivery.last_error = AlertDelivery.State.FAILED, "not sent: the webhook was disabled"
            delivery.save(update_fields=["state", "last_error"])
            return delivery.state
        delivery.attempts += 1
        delivery.next_attempt_at = now + dt.timedelta(seconds=CLAIM_S)
        delivery.save(update_fields=["attempts", "next_attempt_at"])
    outcome = post(url=delivery.webhook.url, payload=delivery.payload)
    fields = {"last_error": outcome.error}
    if outcome.delivered:
        fields.update(state=AlertDelivery.State.DELIVERED, delivered_at=now)
    elif outcome.retry and delivery.attempts < MAX_ATTEMPTS:
        wait = outcome.retry_after if outcome.retry_after is not None else backoff(delivery.attempts)
        fields.update(next_attempt_at=now + dt.timedelta(seconds=wait))
    else:
        fields.update(state=AlertDelivery.State.FAILED)
        if outcome.retry:
            fields["last_error"] = f"gave up after {delivery.attempts} attempts; last: {outcome.error}"[:500]
        log.error("alert delivery %s to webhook %s failed: %s", delivery.pk, delivery.webhook.name,
                  fields["last_error"])
    # Only the claim this call made: a sweep that found the claim run out owns the row now.
    AlertDelivery.objects.filter(pk=delivery.pk, attempts=delivery.attempts,
                                 state=AlertDelivery.State.PENDING).update(**fields)
    return fields.get("state", AlertDelivery.State.PENDING)


def webhook_probe(*, webhook: Webhook, now: dt.datetime | None = None) -> Outcome:
    """Send a test message now, once (the operator waits for the answer on the page)."""
    return post(url=webhook.url, payload=slack.probe_message(webhook=webhook.name, at=now or timezone.now()))
