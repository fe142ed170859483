"""Evaluating rules: each kind fires once while its condition holds, stays quiet while it still
holds, resolves when it clears, and fires again (a new alert) when it comes back."""

from __future__ import annotations

import datetime as dt
import threading
from decimal import Decimal

import pytest
from django.db import IntegrityError, connection, transaction

from controlplane.alerts import conditions
from controlplane.alerts.models import Alert, AlertDelivery, AlertRule
from controlplane.alerts.services import alert_rule_set_enabled, alerts_evaluate
from controlplane.fleet.models import EngineEvent, EngineInstance
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota
from tests.controlplane.alerts.conftest import later, usage
from tests.factories import AlertRuleFactory, WebhookFactory

pytestmark = pytest.mark.django_db


def firing():
    return list(Alert.objects.filter(state=Alert.State.FIRING).order_by("subject"))


def _spend(tenant, tier, tokens, **fields):
    usage_record(record=UsageRecord(request_id=f"req_spend_{tenant.name}_{Alert.objects.count()}_{tokens}_{fields}",
                                    tenant_id=tenant.pk, api_key_id=None, tier_id=tier.pk, text_tokens=tokens, **fields))


def test_it_fires_once_for_a_tenant_over_its_quota_resolves_when_raised_and_fires_again(world, only_rule, now):
    rule = only_rule(kind="quota_use", threshold=80)
    quota = Quota.objects.create(tenant=world.alice, period="month", total_tokens=1000)
    Quota.objects.create(tenant=world.bob, period="month", total_tokens=1000)
    _spend(world.alice, world.text, 850)
    _spend(world.bob, world.text, 100)

    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert (alert.rule, alert.subject, alert.value) == (rule, "tenant:alice", Decimal("85.00"))
    assert alert.message == "tenant alice has used 85 % of its total tokens (850 of 1,000 this month)"

    assert alerts_evaluate(now=later(now, seconds=30)).fired == 0  # still true: quiet
    assert Alert.objects.count() == 1

    quota.total_tokens = 10_000
    quota.save()
    result = alerts_evaluate(now=later(now, minutes=1))
    assert (result.fired, result.resolved) == (0, 1)
    alert.refresh_from_db()
    assert alert.state == "resolved" and alert.resolved_at == later(now, minutes=1)
    assert alert.resolution.startswith("cleared: tenant alice has used 8 % of its total tokens")

    quota.total_tokens = 1000
    quota.save()
    assert alerts_evaluate(now=later(now, minutes=2)).fired == 1
    assert Alert.objects.filter(subject="tenant:alice").count() == 2 and len(firing()) == 1


def test_it_reads_every_limit_of_a_quota_and_names_those_over(world, only_rule, now):
    only_rule(kind="quota_use", threshold=90)
    Quota.objects.create(tenant=world.alice, period="day", image_tokens=1000, total_tokens=100_000)
    _spend(world.alice, world.vision, 0, image_tokens=950)
    alerts_evaluate(now=now)
    (alert,) = firing()
    assert alert.message == "tenant alice has used 95 % of its image tokens (950 of 1,000 today)"


def test_a_rule_for_one_tenant_watches_that_tenant_alone(world, only_rule, now):
    only_rule(kind="quota_use", threshold=50, tenant=world.bob)
    for tenant in (world.alice, world.bob):
        Quota.objects.create(tenant=tenant, period="month", total_tokens=100)
        _spend(tenant, world.text, 90)
    alerts_evaluate(now=now)
    assert [a.subject for a in firing()] == ["tenant:bob"]


def _instance(world, **fields):
    return EngineInstance.objects.create(tier=world.vision, **{"actual_state": "running", "healthy": True, **fields})


def _crash(instance, at, n=1):
    for _ in range(n):
        EngineEvent.objects.create(instance=instance, from_state="running", to_state="crashed",
                                   reason="engine process 1 exited; restart 1 in 10s", created_at=at)


def test_it_fires_once_for_an_engine_crash_looping_and_resolves_when_the_crashes_age_out(world, only_rule, now):
    only_rule(kind="engine_unhealthy", threshold=3, window_minutes=30, for_seconds=120)
    engine = _instance(world, actual_state="starting", restart_count=3)
    steady = _instance(world)
    _crash(steady, later(now, minutes=-5))  # once is not a loop
    _crash(engine, later(now, minutes=-5), n=3)

    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert alert.subject == f"instance:{engine.pk}" and alert.value == 3
    assert alert.message.startswith(f"engine vlm-lite#{engine.pk} crashed 3 times in the last 30 min, now starting")
    _crash(engine, later(now, minutes=-1))
    assert alerts_evaluate(now=later(now, seconds=30)).fired == 0
    assert firing()[0].value == 4  # the reading follows while it fires

    engine.actual_state = "running"
    engine.save()
    assert alerts_evaluate(now=later(now, minutes=31)).resolved == 1
    _crash(engine, later(now, minutes=32), n=3)
    assert alerts_evaluate(now=later(now, minutes=33)).fired == 1
    assert Alert.objects.filter(subject=f"instance:{engine.pk}").count() == 2


def test_it_fires_for_an_engine_down_longer_than_allowed_and_not_for_one_stopped_on_purpose(world, only_rule, now):
    only_rule(kind="engine_unhealthy", threshold=3, window_minutes=30, for_seconds=120)
    failed = _instance(world, actual_state="failed", state_reason="vLLM 0.8 cannot run this architecture")
    EngineEvent.objects.create(instance=failed, from_state="starting", to_state="failed", reason="…",
                               created_at=later(now, seconds=-60))
    stopped = _instance(world, actual_state="failed", desired_state="stopped")
    EngineEvent.objects.create(instance=stopped, from_state="starting", to_state="failed", reason="…",
                               created_at=later(now, hours=-1))

    assert alerts_evaluate(now=now).fired == 0  # a minute is within the 120 s allowed
    assert alerts_evaluate(now=later(now, seconds=61)).fired == 1
    (alert,) = firing()
    assert alert.subject == f"instance:{failed.pk}" and alert.value == 121
    assert alert.message == (f"engine vlm-lite#{failed.pk} has been failed for 121 s: "
                             "vLLM 0.8 cannot run this architecture")

    failed.actual_state = "running"
    failed.save()
    assert alerts_evaluate(now=later(now, seconds=90)).resolved == 1
    failed.desired_state = "stopped"  # an alert on an engine taken out of service on purpose ends too
    failed.actual_state = "failed"
    failed.save()
    assert alerts_evaluate(now=later(now, minutes=10)).fired == 0


def test_it_fires_once_per_tier_for_usage_without_a_rate_and_resolves_once_none_is_recent(world, only_rule, now):
    only_rule(kind="unrated_usage", threshold=1, window_minutes=60)
    usage(tenant=world.alice, tier=world.vision, n=3, rated=False, at=now)
    usage(tenant=world.alice, tier=world.text, n=5, at=now)

    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert (alert.subject, alert.value) == ("tier:vlm-lite", 3)
    assert "3 requests on vlm-lite in the last 60 min were stored without a price" in alert.message
    assert alerts_evaluate(now=later(now, minutes=5)).fired == 0
    assert alerts_evaluate(now=later(now, minutes=61)).resolved == 1
    usage(tenant=world.bob, tier=world.vision, rated=False, at=later(now, minutes=62))
    assert alerts_evaluate(now=later(now, minutes=62)).fired == 1


def test_it_fires_for_a_tiers_server_errors_not_for_client_errors_or_too_few_requests(world, only_rule, now):
    only_rule(kind="error_rate", threshold=5, window_minutes=15, min_requests=20)
    usage(tenant=world.alice, tier=world.vision, n=18, at=now)
    usage(tenant=world.alice, tier=world.vision, n=2, status="error", http_status=503, at=now)
    usage(tenant=world.alice, tier=world.text, n=15, at=now)
    usage(tenant=world.alice, tier=world.text, n=10, status="error", http_status=429, at=now)  # over quota
    usage(tenant=world.bob, tier=world.text, n=3, status="error", http_status=502, at=now)  # 3 of 28: 10.7 %...

    result = alerts_evaluate(now=now)
    assert [(a.subject, a.value) for a in firing()] == [("tier:text", Decimal("10.71")), ("tier:vlm-lite", Decimal("10.00"))]
    assert result.fired == 2
    assert "10.0 % of requests on vlm-lite failed in the last 15 min (2 of 20 answered 5xx)" in firing()[1].message

    usage(tenant=world.alice, tier=world.vision, n=30, at=now)  # 2 of 50: 4 %
    assert alerts_evaluate(now=later(now, seconds=30)).resolved == 1
    usage(tenant=world.alice, tier=world.vision, n=5, status="error", http_status=500, at=now)
    assert alerts_evaluate(now=later(now, seconds=60)).fired == 1


def test_it_fires_when_requests_fail_before_their_model_is_known(world, only_rule, now):
    only_rule(kind="error_rate", threshold=5, window_minutes=15, min_requests=20)
    usage(tenant=world.alice, tier=world.vision, n=20, at=now)
    # The gateway could not read its models: refused with a 503 before any tier was chosen.
    usage(tenant=world.alice, tier=None, n=20, status="error", http_status=503, error_stage="intake", at=now)
    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert alert.subject == "tier:-" and alert.value == Decimal("100.00")
    assert "of requests on no model (refused before one was known) failed" in alert.message


def test_an_error_rate_needs_the_minimum_number_of_requests(world, only_rule, now):
    only_rule(kind="error_rate", threshold=5, window_minutes=15, min_requests=20)
    usage(tenant=world.alice, tier=world.vision, n=10, status="error", http_status=500, at=now)
    assert alerts_evaluate(now=now).fired == 0


def test_it_fires_when_text_waits_past_its_tiers_objective_while_images_meet_theirs(world, only_rule, now):
    world.vision.engine_settings = {**world.vision.engine_settings, "ttft_objective_text_ms": 500,
                                    "ttft_objective_image_ms": 5000}
    world.vision.save()
    only_rule(kind="latency_objective", threshold=100, window_minutes=15, min_requests=10)
    for ttft in range(100, 1100, 100):  # text: 100..1000 ms to the first token, p95 955 ms
        usage(tenant=world.alice, tier=world.vision, stream=True, ttft_ms=ttft, latency_ms=ttft + 200, at=now)
    usage(tenant=world.alice, tier=world.vision, n=12, image_count=1, image_tokens=300, latency_ms=3000, at=now)
    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert (alert.subject, alert.value) == ("tier:vlm-lite:text", Decimal("191.00"))
    assert "text requests on vlm-lite: first token at p95 in 955 ms" in alert.message
    assert "of its 500 ms objective (10 requests)" in alert.message

    usage(tenant=world.alice, tier=world.vision, n=190, stream=True, ttft_ms=50, latency_ms=250, at=now)  # p95 back under
    assert alerts_evaluate(now=later(now, seconds=30)).resolved == 1


def test_a_tier_without_objectives_never_fires_for_latency(world, only_rule, now):
    only_rule(kind="latency_objective", threshold=100, window_minutes=15, min_requests=1)
    usage(tenant=world.alice, tier=world.vision, n=5, stream=True, ttft_ms=60_000, at=now)
    assert alerts_evaluate(now=now).fired == 0


def test_it_fires_for_image_token_counts_that_disagree_and_resolves_when_they_age_out(world, only_rule, now):
    only_rule(kind="count_disagree", threshold=2, window_minutes=60, tier=world.vision)
    usage(tenant=world.alice, tier=world.vision, n=1, image_tokens_disagree=True, at=now)
    assert alerts_evaluate(now=now).fired == 0  # one is below the threshold of 2
    usage(tenant=world.bob, tier=world.vision, n=1, image_tokens_disagree=True, at=now)
    assert alerts_evaluate(now=now).fired == 1
    assert firing()[0].subject == "tier:vlm-lite"
    assert alerts_evaluate(now=later(now, minutes=1)).fired == 0
    assert alerts_evaluate(now=later(now, minutes=61)).resolved == 1
    usage(tenant=world.bob, tier=world.vision, n=2, image_tokens_disagree=True, at=later(now, minutes=62))
    assert alerts_evaluate(now=later(now, minutes=62)).fired == 1


def test_a_fresh_install_alerts_with_the_default_rules(world, now):
    assert set(AlertRule.objects.values_list("kind", flat=True)) == set(AlertRule.Kind.values)
    Quota.objects.create(tenant=world.alice, period="month", total_tokens=1000)
    _spend(world.alice, world.text, 850)
    alerts_evaluate(now=now)
    # The world's tiers are enabled with no engine: each is unserved.
    assert sorted((a.rule.name, a.subject) for a in firing()) == [
        ("Quota 80 % used", "tenant:alice"),
        ("Tier with no engine serving", f"tier:{world.text.name}"),
        ("Tier with no engine serving", f"tier:{world.vision.name}")]


def test_disabling_a_rule_resolves_its_alerts_and_it_raises_no_more(world, only_rule, now):
    rule = only_rule(kind="unrated_usage", threshold=1)
    usage(tenant=world.alice, tier=world.vision, rated=False, at=now)
    alerts_evaluate(now=now)
    alert_rule_set_enabled(rule=rule, enabled=False, actor="olivia")
    assert alerts_evaluate(now=later(now, seconds=30)).resolved == 1
    assert Alert.objects.get().resolution == "its rule was disabled"
    assert alerts_evaluate(now=later(now, seconds=60)).fired == 0


def test_each_change_makes_a_delivery_for_each_enabled_webhook_that_takes_the_kind(world, only_rule, now):
    only_rule(kind="unrated_usage", threshold=1)
    everything = WebhookFactory(name="ops")
    billing = WebhookFactory(name="billing", kinds=["unrated_usage"])
    WebhookFactory(name="fleet", kinds=["engine_unhealthy"])
    WebhookFactory(name="off", enabled=False)
    usage(tenant=world.alice, tier=world.vision, rated=False, at=now)
    alerts_evaluate(now=now)
    alerts_evaluate(now=later(now, hours=2))
    sent = sorted(AlertDelivery.objects.values_list("webhook__name", "event", "state"))
    assert sent == [("billing", "fired", "pending"), ("billing", "resolved", "pending"),
                    ("ops", "fired", "pending"), ("ops", "resolved", "pending")]
    fired = AlertDelivery.objects.get(webhook=everything, event="fired")
    assert fired.payload["text"].startswith(":rotating_light: *FIRING* rule-")
    assert "tier:vlm-lite" in fired.payload["text"] and fired.next_attempt_at == now
    assert billing.deliveries.count() == 2


def test_a_resolution_goes_only_where_the_alert_was_sent_when_it_fired(world, only_rule, now):
    only_rule(kind="unrated_usage", threshold=1)
    WebhookFactory(name="ops")
    usage(tenant=world.alice, tier=world.vision, rated=False, at=now)
    alerts_evaluate(now=now)
    WebhookFactory(name="added-since")
    alerts_evaluate(now=later(now, hours=2))
    assert sorted(AlertDelivery.objects.values_list("webhook__name", "event")) == [("ops", "fired"), ("ops", "resolved")]


def test_a_rule_that_cannot_be_evaluated_does_not_silence_the_others(world, only_rule, now, monkeypatch):
    only_rule(kind="unrated_usage", threshold=1)
    AlertRuleFactory(kind="count_disagree", threshold=1)
    monkeypatch.setitem(conditions._READERS, "count_disagree", lambda rule, now: 1 / 0)
    usage(tenant=world.alice, tier=world.vision, rated=False, image_tokens_disagree=True, at=now)
    assert alerts_evaluate(now=now).fired == 1


def test_the_database_refuses_a_second_firing_alert_for_one_rule_and_subject(world):
    rule = AlertRuleFactory()
    Alert.objects.create(rule=rule, subject="tenant:alice", value=90, message="…")
    with pytest.raises(IntegrityError), transaction.atomic():
        Alert.objects.create(rule=rule, subject="tenant:alice", value=91, message="…")
    Alert.objects.filter(rule=rule).update(state="resolved")
    Alert.objects.create(rule=rule, subject="tenant:alice", value=92, message="…")  # a new episode


@pytest.mark.django_db(transaction=True)
def test_evaluators_running_at_once_fire_an_alert_once(world, only_rule, now):
    only_rule(kind="unrated_usage", threshold=1)
    usage(tenant=world.alice, tier=world.vision, rated=False, at=now)
    start, results = threading.Barrier(4), []

    def evaluate():
        try:
            start.wait()
            results.append(alerts_evaluate(now=now + dt.timedelta(milliseconds=1)))
        finally:
            connection.close()

    threads = [threading.Thread(target=evaluate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(result.fired for result in results) == 1
    assert Alert.objects.count() == 1


def test_a_budget_alert_fires_for_a_soft_budget_and_a_keys_past_the_share_the_operator_set(world, only_rule, now):
    from controlplane.tenants.services import api_key_create

    only_rule(kind="budget_spent", threshold=80)
    Quota.objects.create(tenant=world.alice, spend_limit=Decimal("1.00"), spend_hard=False)
    Quota.objects.create(tenant=world.bob, spend_limit=Decimal("10.00"))
    _spend(world.alice, world.text, 0, output_tokens=1_500_000)  # 0.90 USD
    _spend(world.bob, world.text, 0, output_tokens=1_500_000)  # 9 % of bob's
    capped = api_key_create(tenant=world.charlie, name="ci", spend_limit=Decimal("0.50")).api_key
    usage_record(record=UsageRecord(request_id="req_key_spend", tenant_id=world.charlie.pk, api_key_id=capped.pk,
                                    tier_id=world.text.pk, output_tokens=1_000_000))  # 0.60 USD

    alerts_evaluate(now=now)
    alerts = {alert.subject: alert.message for alert in firing()}
    assert alerts == {
        "tenant:alice": "tenant alice has spent 90 % of its soft budget (alerts only): 0.90 of 1.00 USD this month",
        f"key:{capped.prefix}": "key ci of charlie has spent 120 % of its budget: 0.60 of 0.50 USD this month",
    }
