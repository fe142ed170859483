"""Alerts: rules an operator sets, the alerts they raise (one row per firing episode), the
webhooks alerts go to, and one delivery row per alert, webhook and event (the truth about
what was sent, retried until delivered or given up)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import models
from django.utils import timezone

from controlplane import outbound


@dataclass(frozen=True)
class KindSpec:
    """What a rule kind's threshold means, its bounds, and the scopes and options it takes."""

    threshold_label: str
    minimum: Decimal
    maximum: Decimal
    whole: bool  # a count (whole numbers) or a share (percent)
    scopes: tuple[str, ...]  # of "tier", "tenant"
    uses_window: bool = True
    uses_for_seconds: bool = False
    uses_min_requests: bool = False
    unit: str | None = None  # after the bounds in a refusal; None: " %" for a share, nothing for a count


class AlertRule(models.Model):
    class Kind(models.TextChoices):
        QUOTA_USE = "quota_use", "a tenant's quota use"
        ENGINE_UNHEALTHY = "engine_unhealthy", "an engine crash-looping or down"
        UNRATED_USAGE = "unrated_usage", "usage stored without a rate"
        ERROR_RATE = "error_rate", "a tier's error rate"
        COUNT_DISAGREE = "count_disagree", "the engine's image tokens disagree with the gateway's"
        QUALITY_REGRESSION = "quality_regression", "a tier's accuracy falling between two resolution sweeps"
        LATENCY_OBJECTIVE = "latency_objective", "a request class's first token past its tier's objective"
        TIER_UNSERVED = "tier_unserved", "an enabled tier with no engine serving it"
        BUDGET_SPENT = "budget_spent", "a tenant's or a key's budget spent"

    SPECS = {
        Kind.QUOTA_USE: KindSpec("percent of any limit", Decimal(1), Decimal(100), False, ("tenant",),
                                 uses_window=False),
        Kind.ENGINE_UNHEALTHY: KindSpec("crashes in the window", Decimal(1), Decimal(1000), True, ("tier",),
                                        uses_for_seconds=True),
        Kind.UNRATED_USAGE: KindSpec("unrated requests in the window", Decimal(1), Decimal(10**9), True,
                                     ("tier", "tenant")),
        Kind.ERROR_RATE: KindSpec("percent of requests failing", Decimal("0.1"), Decimal(100), False,
                                  ("tier", "tenant"), uses_min_requests=True),
        Kind.COUNT_DISAGREE: KindSpec("disagreeing requests in the window", Decimal(1), Decimal(10**9), True,
                                      ("tier", "tenant")),
        Kind.QUALITY_REGRESSION: KindSpec("points of accuracy lost at a cap", Decimal("0.1"), Decimal(100), False,
                                          ("tier",), unit=" points"),
        Kind.LATENCY_OBJECTIVE: KindSpec("percent of the objective its p95 reaches", Decimal(10), Decimal(1000),
                                         False, ("tier",), uses_min_requests=True),
        Kind.TIER_UNSERVED: KindSpec("seconds with no engine serving", Decimal(10), Decimal(86400), True, ("tier",),
                                     uses_window=False, unit=" s"),
        Kind.BUDGET_SPENT: KindSpec("percent of a budget spent", Decimal(1), Decimal(1000), False, ("tenant",),
                                    uses_window=False),
    }
    WINDOW_MAX_MINUTES = 7 * 24 * 60
    FOR_SECONDS_MAX = 24 * 3600

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=32, choices=Kind.choices)
    threshold = models.DecimalField(max_digits=12, decimal_places=2)
    window_minutes = models.PositiveIntegerField(
        default=60, help_text="How far back it looks (quota alerts follow the quota's own period)")
    for_seconds = models.PositiveIntegerField(
        default=120, help_text="Engines: unhealthy, crash-looping or failed for at least this long")
    min_requests = models.PositiveIntegerField(
        default=20, help_text="Error rate: only with at least this many requests in the window")
    tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="+", help_text="Only this tier; empty: every tier")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="+", help_text="Only this tenant; empty: every tenant")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["kind", "threshold", "name"]

    def __str__(self):
        return self.name

    @property
    def spec(self) -> KindSpec:
        return self.SPECS[self.kind]

    def clean(self):
        errors = {}
        spec = self.SPECS.get(self.kind)
        if spec is None:
            return  # the field's own choices say so
        if self.threshold is not None:
            unit = spec.unit if spec.unit is not None else "" if spec.whole else " %"
            if not spec.minimum <= self.threshold <= spec.maximum:
                errors["threshold"] = (f"for {self.get_kind_display()}, {spec.threshold_label}: "
                                       f"from {spec.minimum:g}{unit} to {spec.maximum:g}{unit}")
            elif spec.whole and self.threshold != self.threshold.to_integral_value():
                errors["threshold"] = f"{spec.threshold_label}: a whole number"
        if spec.uses_window and not 1 <= (self.window_minutes or 0) <= self.WINDOW_MAX_MINUTES:
            errors["window_minutes"] = f"from 1 to {self.WINDOW_MAX_MINUTES} minutes (a week)"
        if spec.uses_for_seconds and not 10 <= (self.for_seconds or 0) <= self.FOR_SECONDS_MAX:
            errors["for_seconds"] = f"from 10 to {self.FOR_SECONDS_MAX} seconds"
        if spec.uses_min_requests and not (self.min_requests or 0) >= 1:
            errors["min_requests"] = "at least 1 request"
        if self.tier_id and "tier" not in spec.scopes:
            errors["tier"] = f"{self.get_kind_display()} cannot be limited to a tier"
        if self.tenant_id and "tenant" not in spec.scopes:
            errors["tenant"] = f"{self.get_kind_display()} cannot be limited to a tenant"
        if errors:
            raise ValidationError(errors)


class Alert(models.Model):
    """One firing episode of a rule for one subject ("tenant:acme", "instance:12",
    "tier:vlm-lite"). While it fires, no second row for the same rule and subject can exist;
    once resolved, the condition coming back is a new row."""

    class State(models.TextChoices):
        FIRING = "firing", "firing"
        RESOLVED = "resolved", "resolved"

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    subject = models.CharField(max_length=160)
    state = models.CharField(max_length=8, choices=State.choices, default=State.FIRING)
    fired_at = models.DateTimeField(default=timezone.now)
    resolved_at = models.DateTimeField(null=True, blank=True)
    value = models.DecimalField(max_digits=16, decimal_places=2, help_text="The latest reading while firing")
    message = models.CharField(max_length=500)
    resolution = models.CharField(max_length=500, blank=True, help_text="Why it resolved")

    class Meta:
        ordering = ["-fired_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "subject"], condition=models.Q(state="firing"),
                                    name="one_firing_alert_per_rule_and_subject"),
        ]
        indexes = [models.Index(fields=["state", "-fired_at"], name="alerts_by_state")]

    def __str__(self):
        return f"{self.rule} {self.subject} ({self.state})"


def http_url(value: str) -> None:
    URLValidator(schemes=["http", "https"], message="an http:// or https:// address")(value)


class Webhook(models.Model):
    """Where alerts go: an endpoint that takes Slack-compatible JSON (a Slack incoming webhook,
    Mattermost, Rocket.Chat, Teams' and Discord's Slack endpoints, or anything of one's own)."""

    name = models.CharField(max_length=100, unique=True)
    url = models.CharField(max_length=500, validators=[http_url],
                           help_text="e.g. https://hooks.slack.com/services/…; kept out of the audit log")
    enabled = models.BooleanField(default=True)
    kinds = models.JSONField(default=list, blank=True, help_text="Rule kinds sent here; empty: every kind")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def takes(self, kind: str) -> bool:
        return not self.kinds or kind in self.kinds

    def kind_labels(self) -> list[str]:
        return [AlertRule.Kind(kind).label for kind in self.kinds if kind in AlertRule.Kind.values]

    def clean(self):
        errors = {}
        unknown = sorted(set(self.kinds or []) - set(AlertRule.Kind.values))
        if unknown:
            errors["kinds"] = f"unknown rule kinds: {', '.join(unknown)}"
        try:
            http_url(self.url)
        except ValidationError:
            pass  # said by the field
        else:
            refused = outbound.url_refusal(self.url, trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS,
                                           what="webhook URL")
            if refused:
                errors["url"] = refused
        if errors:
            raise ValidationError(errors)


class AlertDelivery(models.Model):
    """One alert event (fired or resolved) for one webhook. The row is the truth: a worker that
    dies mid-send leaves it pending, and the next sweep sends it again."""

    class Event(models.TextChoices):
        FIRED = "fired", "fired"
        RESOLVED = "resolved", "resolved"

    class State(models.TextChoices):
        PENDING = "pending", "pending"
        DELIVERED = "delivered", "delivered"
        FAILED = "failed", "failed"  # given up: the page shows it with the last error

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=8, choices=Event.choices)
    payload = models.JSONField(help_text="What is posted, fixed when the event happened")
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["alert", "webhook", "event"], name="one_delivery_per_alert_webhook_event"),
        ]
        indexes = [
            models.Index(fields=["next_attempt_at"], condition=models.Q(state="pending"), name="alert_deliveries_due"),
            models.Index(fields=["webhook", "state", "-created_at"], name="alert_deliveries_by_webhook"),
        ]

    def __str__(self):
        return f"{self.alert} {self.event} → {self.webhook} ({self.state})"
