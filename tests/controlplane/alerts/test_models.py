"""What a rule and a webhook accept, whichever path saves them."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from controlplane.alerts.models import AlertRule, Webhook

pytestmark = pytest.mark.django_db


def errors_of(obj) -> dict:
    with pytest.raises(ValidationError) as refused:
        obj.full_clean()
    return refused.value.message_dict


def test_it_keeps_each_kinds_threshold_within_its_bounds():
    assert errors_of(AlertRule(name="r", kind="quota_use", threshold=120))["threshold"] == [
        "for a tenant's quota use, percent of any limit: from 1 % to 100 %"]
    assert errors_of(AlertRule(name="r", kind="error_rate", threshold=0))["threshold"] == [
        "for a tier's error rate, percent of requests failing: from 0.1 % to 100 %"]
    assert errors_of(AlertRule(name="r", kind="engine_unhealthy", threshold="2.5"))["threshold"] == [
        "crashes in the window: a whole number"]
    AlertRule(name="r", kind="error_rate", threshold="2.5").full_clean()


def test_it_wants_a_window_a_down_time_and_a_minimum_that_make_sense():
    assert errors_of(AlertRule(name="r", kind="unrated_usage", threshold=1, window_minutes=0))["window_minutes"] == [
        "from 1 to 10080 minutes (a week)"]
    assert errors_of(AlertRule(name="r", kind="engine_unhealthy", threshold=3, for_seconds=5))["for_seconds"] == [
        "from 10 to 86400 seconds"]
    assert errors_of(AlertRule(name="r", kind="error_rate", threshold=5, min_requests=0))["min_requests"] == [
        "at least 1 request"]
    AlertRule(name="r", kind="quota_use", threshold=80, window_minutes=0).full_clean()  # quotas have their period


def test_it_refuses_a_scope_the_kind_has_no_use_for(world):
    assert errors_of(AlertRule(name="r", kind="quota_use", threshold=80, tier=world.vision))["tier"] == [
        "a tenant's quota use cannot be limited to a tier"]
    assert errors_of(AlertRule(name="r", kind="engine_unhealthy", threshold=3, tenant=world.alice))["tenant"] == [
        "an engine crash-looping or down cannot be limited to a tenant"]
    AlertRule(name="r", kind="error_rate", threshold=5, tier=world.vision, tenant=world.alice).full_clean()


def test_a_webhook_posts_to_http_or_https_only():
    for url in ("ftp://example.com/hook", "file:///etc/passwd", "hooks.slack.com/services/x", "javascript:alert(1)"):
        assert errors_of(Webhook(name="w", url=url))["url"] == ["an http:// or https:// address"]
    Webhook(name="w", url="https://hooks.slack.com/services/T0/B0/abc").full_clean()


@pytest.mark.parametrize("url, reason", [
    ("http://10.0.0.5:8080/alerts", "resolves to 10.0.0.5, a private address"),
    ("http://127.0.0.1:9/hook", "a loopback address"),
    ("http://169.254.169.254/latest/meta-data/", "a cloud metadata address"),
    ("http://[::ffff:0:a9fe:a9fe]/", "a cloud metadata address"),
    ("https://ops:secret@hooks.example.com/x", "must not contain a user name or password"),
])
def test_a_webhook_inside_the_network_is_refused(url, reason):
    (error,) = errors_of(Webhook(name="w", url=url))["url"]
    assert error.startswith("webhook URL") and reason in error


def test_a_webhook_inside_the_network_is_an_explicit_choice(settings):
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["10.0.0.0/8"]
    Webhook(name="w", url="http://10.0.0.5:8080/alerts").full_clean()  # a receiver inside the network
    assert "a loopback address" in errors_of(Webhook(name="w", url="http://127.0.0.1:9/hook"))["url"][0]


def test_a_webhook_takes_known_kinds_only():
    assert errors_of(Webhook(name="w", url="https://example.com/h", kinds=["quota_use", "nope"]))["kinds"] == [
        "unknown rule kinds: nope"]
    assert Webhook(kinds=[]).takes("quota_use") and not Webhook(kinds=["error_rate"]).takes("quota_use")
