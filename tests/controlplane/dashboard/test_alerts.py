"""The Alerts page: what fires (since when, how much, which rule, where it was sent), what
resolved, whether each webhook takes its deliveries, and the rules and webhooks, for operators."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone

from controlplane.alerts.delivery import MAX_ATTEMPTS, delivery_attempt
from controlplane.alerts.models import Alert, AlertDelivery, AlertRule, Webhook
from controlplane.alerts.services import alerts_evaluate
from controlplane.audit.models import AuditEntry
from controlplane.metering.models import UsageEvent
from tests.factories import AlertRuleFactory, WebhookFactory
from tests.pages import field_errors
from tests.webhooks import webhook_receiver

pytestmark = pytest.mark.django_db


def _unrated(world, n=1):
    for i in range(n):
        UsageEvent.objects.create(request_id=f"req_page_{UsageEvent.objects.count()}_{i}", tenant=world.alice,
                                  tier=world.vision, status="ok", rated=False)


def _section(page: str, name: str) -> str:
    return page.split(f'id="{name}"')[1].split("</section>")[0]


def test_the_page_is_for_operators(client, world):
    for user in (world.finance, world.alice_admin):
        client.force_login(user)
        assert client.get("/alerts/").status_code == 403
        assert client.post("/alerts/rules/new/", {}).status_code == 403
    client.force_login(world.finance)
    assert 'id="nav-alerts"' not in client.get("/").content.decode()


def test_it_shows_firing_alerts_first_with_their_deliveries_and_a_count_in_the_nav(client, world, settings):
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]
    webhook = WebhookFactory(name="ops-slack", url="http://127.0.0.1:9/hooks/T0/B0/very-secret")
    _unrated(world, 3)
    AlertRule.objects.filter(kind="tier_unserved").update(enabled=False)  # the world's tiers have no engine
    Alert.objects.create(rule=AlertRule.objects.get(name="Quota 80 % used"), subject="tenant:bob", value=91,
                         message="old news", state="resolved", resolved_at=timezone.now())
    alerts_evaluate()
    delivery = AlertDelivery.objects.get()
    for _ in range(MAX_ATTEMPTS):  # nothing listens on port 9: retried, then given up
        AlertDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now())
        delivery_attempt(delivery_id=delivery.pk)
    client.force_login(world.operator)
    page = client.get("/alerts/").content.decode()

    assert page.index('id="firing"') < page.index('id="resolved"') < page.index('id="webhooks"')
    row = _section(page, "firing").split('data-alert="unrated_usage:tier:vlm-lite"')[1].split("</tr>")[0]
    assert "Usage without a rate" in row and ">3<" in row and re.search(r" UTC \((?:now|[^()]+ ago)\)", row)
    assert "3 requests on vlm-lite in the last 60 min were stored without a price" in row
    assert f"ops-slack: <span class=\"error\">failed after {MAX_ATTEMPTS} attempts</span>" in row
    assert "old news" in _section(page, "resolved")
    hooks = _section(page, "webhooks")
    listed = hooks.split('data-webhook="ops-slack"')[1].split("</tr>")[0]
    assert f"gave up after {MAX_ATTEMPTS} attempts; last: ConnectError" in listed
    assert "very-secret" not in page and "http://127.0.0.1:9/hooks/T0/B0/…" in listed
    assert 'id="failed-deliveries"' in hooks and f'data-delivery="{delivery.pk}"' in hooks
    assert '<span class="badge alert" title="alerts firing">1</span>' in page
    webhook.delete()


def test_a_rule_is_checked_on_its_page_and_each_change_recorded(client, world):
    client.force_login(world.operator)
    page = client.post("/alerts/rules/new/", {"name": "Quota nearly gone", "kind": "quota_use", "threshold": "150",
                                              "window_minutes": "60", "for_seconds": "120", "min_requests": "20",
                                              "tier": world.vision.pk, "enabled": "on"}).content.decode()
    assert "for a tenant's quota use, percent of any limit: from 1 % to 100 %" in field_errors(page)
    assert "a tenant's quota use cannot be limited to a tier" in field_errors(page)
    assert not AlertRule.objects.filter(name="Quota nearly gone").exists()

    response = client.post("/alerts/rules/new/", {"name": "Quota nearly gone", "kind": "quota_use", "threshold": "95",
                                                  "window_minutes": "60", "for_seconds": "120", "min_requests": "20",
                                                  "tenant": world.alice.pk, "enabled": "on"})
    assert response.status_code == 302 and response["Location"] == "/alerts/"
    rule = AlertRule.objects.get(name="Quota nearly gone")
    assert (rule.threshold, rule.tenant) == (95, world.alice)
    created = AuditEntry.objects.get(object_type="alert rule", object_id=str(rule.pk))
    assert created.actor == world.operator.username and created.changes["threshold"] == [None, "95"]

    client.post(f"/alerts/rules/{rule.pk}/disable/")
    rule.refresh_from_db()
    assert not rule.enabled
    changed = AuditEntry.objects.filter(object_type="alert rule", object_id=str(rule.pk)).first()
    assert changed.changes == {"enabled": [True, False]}
    page = client.get(f"/alerts/rules/{rule.pk}/").content.decode()
    assert 'id="changes"' in page and "<code>enabled</code>: True → False" in page


def test_a_webhook_is_checked_and_its_secret_kept_out_of_the_audit_log(client, world):
    client.force_login(world.operator)
    page = client.post("/alerts/webhooks/new/", {"name": "ops", "url": "ftp://hooks.example.com/x"}).content.decode()
    assert "an http:// or https:// address" in field_errors(page)
    response = client.post("/alerts/webhooks/new/", {
        "name": "ops", "url": "https://hooks.slack.com/services/T0/B0/s3cr3t", "enabled": "on",
        "kinds": ["engine_unhealthy", "error_rate"]})
    assert response.status_code == 302
    webhook = Webhook.objects.get(name="ops")
    assert webhook.kinds == ["engine_unhealthy", "error_rate"]
    entry = AuditEntry.objects.get(object_type="webhook")
    assert entry.changes["url"] == [None, "https://hooks.slack.com/services/T0/B0/…"]
    assert "s3cr3t" not in str(entry.changes)

    client.post(f"/alerts/webhooks/{webhook.pk}/", {"name": "ops", "url": "https://hooks.slack.com/services/T0/B0/n3w",
                                                    "enabled": "on"})
    changed = AuditEntry.objects.filter(object_type="webhook").first()
    assert changed.changes["url"] == ["https://hooks.slack.com/services/T0/B0/… (before the change)",
                                      "https://hooks.slack.com/services/T0/B0/…"]
    assert changed.changes["kinds"] == ["engine_unhealthy, error_rate", "every kind"]
    client.post(f"/alerts/webhooks/{webhook.pk}/disable/")
    assert not Webhook.objects.get(pk=webhook.pk).enabled


def test_send_test_delivers_a_message_and_says_how_it_went_not_what_was_answered(client, world, settings):
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]  # the receiver's
    client.force_login(world.operator)
    with webhook_receiver() as receiver:
        webhook = WebhookFactory(name="ops", url=receiver.url)
        page = client.post(f"/alerts/webhooks/{webhook.pk}/test/", follow=True).content.decode()
        assert re.search(r"Test message delivered to ops: HTTP 200 OK in \d+ ms\.", page)
        assert receiver.texts()[0].startswith(":wave: Test message from the VLM control plane to webhook ops")
        receiver.answer(403, "invalid_token of the internal service")
        page = client.post(f"/alerts/webhooks/{webhook.pk}/test/", follow=True).content.decode()
        assert re.search(r"Test message to ops failed: HTTP 403 Forbidden after \d+ ms\.", page)
        assert "invalid_token" not in page


def test_a_webhook_inside_the_network_is_a_form_error(client, world):
    client.force_login(world.operator)
    page = client.post("/alerts/webhooks/new/", {"name": "ops", "url": "http://169.254.169.254/latest/"}).content.decode()
    (error,) = field_errors(page)
    assert error.endswith("resolves to 169.254.169.254, a cloud metadata address")
    assert not Webhook.objects.exists()


def test_a_rule_with_its_alerts_shows_how_it_fires(client, world):
    AlertRuleFactory(name="Errors on lite", kind="error_rate", threshold=2, min_requests=50, tier=world.vision)
    client.force_login(world.operator)
    rules = _section(client.get("/alerts/").content.decode(), "rules")
    row = [part for part in rules.split("<tr ") if "Errors on lite" in part][0]
    assert "2 percent of requests failing, with 50+ requests" in row and "tier vlm-lite" in row


def test_the_page_makes_the_same_few_queries_however_many_alerts_there_are(client, world,
                                                                             django_assert_max_num_queries):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    rules = AlertRule.objects.all()
    WebhookFactory(name="ops")
    WebhookFactory(name="billing", kinds=["unrated_usage"])

    def alerts(n):
        for i in range(n):
            alert = Alert.objects.create(rule=rules[i % len(rules)], subject=f"tenant:t{Alert.objects.count()}",
                                         value=90, message="…")
            for webhook in Webhook.objects.all():
                AlertDelivery.objects.create(alert=alert, webhook=webhook, event="fired", payload={"text": "…"})

    alerts(2)
    client.force_login(world.operator)
    with CaptureQueriesContext(connection) as few:
        assert client.get("/alerts/").status_code == 200
    alerts(30)
    with django_assert_max_num_queries(len(few)):
        page = client.get("/alerts/").content.decode()
    assert page.count('data-alert="') == 32 and "unrated_usage" not in _section(page, "webhooks").split("<tbody>")[1]
