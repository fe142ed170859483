"""Alert writes: evaluating the rules (fire, keep, resolve), the deliveries each change makes,
and the changes operators make to rules and webhooks (each recorded in the audit log).

Safe with any number of evaluators at once (beat overlapping itself, two beats): each rule is
evaluated under its row lock, skipped by whoever finds it locked, and the database refuses a
second firing alert for one rule and subject whatever happens."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.alerts import slack
from controlplane.alerts.conditions import Reading, readings
from controlplane.alerts.models import Alert, AlertDelivery, AlertRule, Webhook
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, field_values

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    fired: int = 0
    resolved: int = 0


def alerts_evaluate(*, now: dt.datetime | None = None) -> Evaluation:
    """Evaluate every rule: fire what newly crosses its threshold, resolve what cleared (or
    whose rule was disabled), keep the rest as it is. A rule that fails to evaluate is logged
    and skipped, so one broken rule never silences the others."""
    now = now or timezone.now()
    fired = resolved = 0
    for rule_id in AlertRule.objects.order_by("pk").values_list("pk", flat=True):
        try:
            result = _rule_evaluate(rule_id, now)
        except Exception:
            log.exception("alert rule %s could not be evaluated", rule_id)
            continue
        fired, resolved = fired + result.fired, resolved + result.resolved
    return Evaluation(fired=fired, resolved=resolved)


@transaction.atomic
def _rule_evaluate(rule_id: int, now: dt.datetime) -> Evaluation:
    rule = AlertRule.objects.select_for_update(skip_locked=True, of=("self",)).select_related(
        "tier", "tenant").filter(pk=rule_id).first()
    if rule is None:
        return Evaluation()  # deleted, or another evaluator holds it right now: it does the work
    firing = {alert.subject: alert for alert in rule.alerts.filter(state=Alert.State.FIRING)}
    if not rule.enabled:
        for alert in firing.values():
            _resolve(alert, now, "its rule was disabled")
        return Evaluation(resolved=len(firing))
    found = readings(rule=rule, now=now)
    fired = resolved = 0
    for subject, reading in found.items():
        alert = firing.get(subject)
        if reading.breached and alert is None:
            fired += _fire(rule, reading, now)
        elif reading.breached and (alert.value, alert.message) != (reading.value, reading.message[:500]):
            alert.value, alert.message = reading.value, reading.message[:500]
            alert.save(update_fields=["value", "message"])
        elif not reading.breached and alert is not None:
            _resolve(alert, now, f"cleared: {reading.message}")
            resolved += 1
    for subject, alert in firing.items():
        if subject not in found:
            _resolve(alert, now, "cleared: no longer seen (nothing measured in the window, or the subject is "
                                 "gone or out of the rule's scope)")
            resolved += 1
    return Evaluation(fired=fired, resolved=resolved)


def _fire(rule: AlertRule, reading: Reading, now: dt.datetime) -> int:
    try:
        with transaction.atomic():
            alert = Alert.objects.create(rule=rule, subject=reading.subject, value=reading.value,
                                         message=reading.message[:500], fired_at=now)
    except IntegrityError:
        return 0  # it is firing already (another evaluator got there first): fire once
    log.warning("alert fired: %s %s: %s", rule.name, reading.subject, reading.message)
    _deliveries_create(alert, AlertDelivery.Event.FIRED, now)
    return 1


def _resolve(alert: Alert, now: dt.datetime, why: str) -> None:
    alert.state, alert.resolved_at, alert.resolution = Alert.State.RESOLVED, now, why[:500]
    alert.save(update_fields=["state", "resolved_at", "resolution"])
    log.info("alert resolved: %s %s: %s", alert.rule.name, alert.subject, why)
    _deliveries_create(alert, AlertDelivery.Event.RESOLVED, now)


def _deliveries_create(alert: Alert, event: str, now: dt.datetime) -> None:
    """A delivery row per webhook that takes this kind, sent once the change is committed (and
    by the sweep, should the broker or the worker be away)."""
    payload = slack.alert_message(event=event, rule=alert.rule.name, subject=alert.subject, message=alert.message,
                                  fired_at=alert.fired_at, resolved_at=alert.resolved_at, resolution=alert.resolution)
    webhooks = Webhook.objects.filter(enabled=True)
    if event == AlertDelivery.Event.RESOLVED:
        # Only where it was told it fired: a lone "resolved" for something never seen is noise.
        webhooks = webhooks.filter(deliveries__alert=alert, deliveries__event=AlertDelivery.Event.FIRED)
    webhooks = [webhook for webhook in webhooks if webhook.takes(alert.rule.kind)]
    deliveries = [AlertDelivery.objects.create(alert=alert, webhook=webhook, event=event, payload=payload,
                                               created_at=now, next_attempt_at=now) for webhook in webhooks]
    if deliveries:
        transaction.on_commit(lambda: deliveries_enqueue(ids=[d.pk for d in deliveries]))


def deliveries_enqueue(*, ids: list[int]) -> None:
    # The tasks module imports this one: imported here, where a task is enqueued.
    from controlplane.alerts.tasks import alert_deliver

    for delivery_id in ids:
        try:
            alert_deliver.delay(delivery_id)
        except Exception:  # noqa: BLE001 - the broker is away: the sweep sends it
            log.warning("could not enqueue alert delivery %s; the sweep will send it", delivery_id)


# --- changes operators make -----------------------------------------------------------------

RULE_AUDITED = ("name", "kind", "threshold", "window_minutes", "for_seconds", "min_requests", "tier_id",
                "tenant_id", "enabled")
WEBHOOK_AUDITED = ("name", "url", "enabled", "kinds")


def masked_url(url: str) -> str:
    """A webhook's address without its secret: Slack's URLs are bearer tokens, and the audit
    log (read by finance too) and the list must not hand them out."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    shown = path.rsplit("/", 1)[0] if path.count("/") > 1 else ""
    return f"{parts.scheme}://{parts.netloc}{shown}/…" if parts.netloc else "…"


def _webhook_values(webhook: Webhook) -> dict:
    values = field_values(webhook, WEBHOOK_AUDITED)
    values["url"] = masked_url(webhook.url)
    values["kinds"] = ", ".join(webhook.kinds) if webhook.kinds else "every kind"
    return values


@transaction.atomic
def alert_rule_save(*, rule: AlertRule, actor: str) -> AlertRule:
    """Save a rule that passed its checks (full_clean), recording what changed. The next
    evaluation applies it: alerts it no longer fires for resolve then."""
    created = rule.pk is None
    before = {} if created else field_values(AlertRule.objects.get(pk=rule.pk), RULE_AUDITED)
    rule.save()
    audit_record(actor=actor, action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                 obj=rule, before=before, after=field_values(rule, RULE_AUDITED))
    return rule


def alert_rule_set_enabled(*, rule: AlertRule, enabled: bool, actor: str) -> AlertRule:
    rule.enabled = enabled
    return alert_rule_save(rule=rule, actor=actor)


@transaction.atomic
def webhook_save(*, webhook: Webhook, actor: str) -> Webhook:
    created = webhook.pk is None
    before = {} if created else _webhook_values(Webhook.objects.get(pk=webhook.pk))
    if not created and before["url"] == masked_url(webhook.url) and Webhook.objects.filter(
            pk=webhook.pk).exclude(url=webhook.url).exists():
        before["url"] += " (before the change)"  # the secret part changed: say so, without it
    webhook.save()
    audit_record(actor=actor, action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                 obj=webhook, before=before, after=_webhook_values(webhook))
    return webhook


def webhook_set_enabled(*, webhook: Webhook, enabled: bool, actor: str) -> Webhook:
    webhook.enabled = enabled
    return webhook_save(webhook=webhook, actor=actor)
