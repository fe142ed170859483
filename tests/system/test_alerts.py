"""Alerts from a started system: a tenant's real requests through the gateway cross a quota
rule, the running beat and worker deliver the alert to a webhook receiver (retrying its first
failure), and the resolution once an operator raises the quota."""

from __future__ import annotations

import secrets

import openai
import pytest

from controlplane.alerts.models import Alert, AlertDelivery, AlertRule, Webhook
from controlplane.tenants.models import ApiKey, Quota, Tenant
from controlplane.tenants.services import KEY_PREFIX, key_hash
from tests.system.harness import wait_for
from tests.webhooks import webhook_receiver

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]


def _tenant_with_key(db, name: str, total_tokens: int) -> tuple[Tenant, str]:
    tenant = Tenant.objects.using(db).create(name=name)
    Quota.objects.using(db).create(tenant=tenant, period="month", total_tokens=total_tokens)
    prefix = secrets.token_hex(4)
    secret = f"{KEY_PREFIX}{prefix}-{secrets.token_urlsafe(32)}"
    ApiKey.objects.using(db).create(tenant=tenant, name="alerts", prefix=prefix, key_hash=key_hash(secret))
    return tenant, secret


def test_it_delivers_a_quota_alert_and_its_resolution_from_the_running_system(system, system_db):
    tenant, secret = _tenant_with_key(system_db, "alerts-e2e", total_tokens=1000)
    rule = AlertRule.objects.using(system_db).create(name="e2e quota", kind="quota_use", threshold=1, tenant=tenant)
    with webhook_receiver() as receiver:
        webhook = Webhook.objects.using(system_db).create(name="e2e", url=receiver.url, kinds=["quota_use"])
        # The first attempt fails (other alerts of the system may come here too: those are taken).
        receiver.answer(500, "try again", when="tenant:alerts-e2e")
        try:
            client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=secret, max_retries=0)
            reply = client.chat.completions.create(model="text", max_tokens=8,
                                                   messages=[{"role": "user", "content": "Say hello."}])
            used = reply.usage.total_tokens
            assert 10 <= used < 1000  # a few percent of the quota: over the rule's 1 %

            def ours(kind):
                return [text for text in receiver.texts() if f"*{kind}* e2e quota · tenant:alerts-e2e" in text]

            # The first post failed, the second (after the backoff) was taken: the same message twice.
            wait_for(lambda: len(ours("FIRING")) >= 2, timeout=60, interval=0.5,
                     what="the fired alert at the receiver, the second time")
            assert ours("FIRING")[0] == ours("FIRING")[1]
            assert f"tenant alerts-e2e has used {100 * used / 1000:.0f} % of its total tokens ({used} of 1,000 " \
                   "this month)" in ours("FIRING")[0]
            alert = Alert.objects.using(system_db).get(rule=rule)
            assert alert.state == "firing"
            sent = wait_for(lambda: AlertDelivery.objects.using(system_db).filter(
                alert=alert, event="fired", state="delivered").first(), timeout=10, what="the delivery's row")
            assert (sent.attempts, sent.last_error) == (2, "")

            Quota.objects.using(system_db).filter(tenant=tenant).update(total_tokens=10**12)  # the operator raises it
            wait_for(lambda: ours("RESOLVED"), timeout=60, interval=0.5, what="the resolution at the receiver")
            assert "cleared: tenant alerts-e2e has used 0 % of its total tokens" in ours("RESOLVED")[0]
            alert.refresh_from_db()
            assert alert.state == "resolved"
            # Fired once: many evaluations ran while it held, and none fired it again.
            assert Alert.objects.using(system_db).filter(rule=rule).count() == 1
            assert len(ours("FIRING")) == 2 and len(ours("RESOLVED")) == 1
        finally:
            webhook.delete()
            rule.delete()
            Tenant.objects.using(system_db).filter(pk=tenant.pk).update(active=False)
