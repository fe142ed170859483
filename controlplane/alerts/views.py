"""Alerts for operators: what fires now and since when, what resolved lately, whether each
webhook takes its deliveries (failures with their last error), and the rules and webhooks
themselves (changes recorded in the audit log; a test message on demand)."""

from __future__ import annotations

import datetime as dt

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.alerts.delivery import webhook_probe
from controlplane.alerts.forms import AlertRuleForm, WebhookForm
from controlplane.alerts.models import AlertRule, Webhook
from controlplane.alerts.selectors import (
    alerts_firing,
    alerts_resolved_recently,
    deliveries_failed_recently,
    webhooks_with_delivery_status,
)
from controlplane.alerts.services import (
    alert_rule_save,
    alert_rule_set_enabled,
    masked_url,
    webhook_save,
    webhook_set_enabled,
)
from controlplane.audit.services import history
from controlplane.web.access import operators_only

RECENT = dt.timedelta(days=7)


@login_required
def alert_list(request):
    operators_only(request)
    since = timezone.now() - RECENT
    webhooks = webhooks_with_delivery_status(since=since)
    for webhook in webhooks:
        webhook.shown_url = masked_url(webhook.url)
    return render(request, "alerts/alerts.html", {
        "firing": list(alerts_firing()), "resolved": list(alerts_resolved_recently(since=since)),
        "webhooks": webhooks, "failed": list(deliveries_failed_recently(since=since)),
        "rules": list(AlertRule.objects.select_related("tier", "tenant")),
    })


@login_required
def rule_new(request):
    operators_only(request)
    return _rule_form(request, AlertRule())


@login_required
def rule_edit(request, pk):
    operators_only(request)
    return _rule_form(request, get_object_or_404(AlertRule, pk=pk))


def _rule_form(request, rule: AlertRule):
    creating = rule.pk is None
    form = AlertRuleForm(request.POST or None, instance=rule)
    if request.method == "POST" and form.is_valid():
        rule = alert_rule_save(rule=form.save(commit=False), actor=request.user.get_username())
        messages.success(request, f"Rule {rule.name} {'created' if creating else 'saved'}; it applies from the next evaluation.")
        return redirect("dashboard:alerts")
    return render(request, "alerts/alert_rule_form.html", {
        "form": form, "rule": rule, "creating": creating, "specs": AlertRule.SPECS,
        "history": [] if creating else list(history(rule)[:20])})


@login_required
@require_POST
def rule_enable(request, pk, enabled: bool):
    operators_only(request)
    rule = get_object_or_404(AlertRule, pk=pk)
    alert_rule_set_enabled(rule=rule, enabled=enabled, actor=request.user.get_username())
    messages.success(request, f"Rule {rule.name} {'enabled' if enabled else 'disabled: its alerts resolve at the next evaluation'}.")
    return redirect("dashboard:alerts")


@login_required
def webhook_new(request):
    operators_only(request)
    return _webhook_form(request, Webhook())


@login_required
def webhook_edit(request, pk):
    operators_only(request)
    return _webhook_form(request, get_object_or_404(Webhook, pk=pk))


def _webhook_form(request, webhook: Webhook):
    creating = webhook.pk is None
    form = WebhookForm(request.POST or None, instance=webhook)
    if request.method == "POST" and form.is_valid():
        webhook = webhook_save(webhook=form.save(commit=False), actor=request.user.get_username())
        messages.success(request, f"Webhook {webhook.name} {'created' if creating else 'saved'}.")
        return redirect("dashboard:alerts")
    return render(request, "alerts/webhook_form.html", {
        "form": form, "webhook": webhook, "creating": creating,
        "history": [] if creating else list(history(webhook)[:20])})


@login_required
@require_POST
def webhook_enable(request, pk, enabled: bool):
    operators_only(request)
    webhook = get_object_or_404(Webhook, pk=pk)
    webhook_set_enabled(webhook=webhook, enabled=enabled, actor=request.user.get_username())
    messages.success(request, f"Webhook {webhook.name} {'enabled' if enabled else 'disabled'}.")
    return redirect("dashboard:alerts")


@login_required
@require_POST
def webhook_test(request, pk):
    operators_only(request)
    webhook = get_object_or_404(Webhook, pk=pk)
    outcome = webhook_probe(webhook=webhook)
    if outcome.delivered:
        messages.success(request, f"Test message delivered to {webhook.name}: {outcome.summary}.")
    else:
        messages.error(request, f"Test message to {webhook.name} failed: {outcome.summary}.")
    return redirect("dashboard:alerts")
