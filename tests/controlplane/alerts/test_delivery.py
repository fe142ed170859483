"""Delivering alerts to a real HTTP receiver: Slack-compatible JSON, retried with backoff when
the receiver fails or cannot be reached, given up after a bound, each step on the row."""

from __future__ import annotations

import socket
import time

import pytest

from controlplane.alerts import delivery as delivery_module
from controlplane.alerts.delivery import MAX_ATTEMPTS, delivery_attempt, webhook_probe
from controlplane.alerts.models import AlertDelivery
from controlplane.alerts.selectors import deliveries_due
from controlplane.alerts.services import alerts_evaluate
from tests.controlplane.alerts.conftest import later, usage
from tests.factories import WebhookFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def fired(world, only_rule, receiver, now):
    """An unrated-usage alert fired for a webhook pointing at the receiver: its pending delivery."""
    only_rule(name="Usage without a rate", kind="unrated_usage", threshold=1, window_minutes=60)
    WebhookFactory(name="ops-slack", url=receiver.url)
    usage(tenant=world.alice, tier=world.vision, n=2, rated=False, at=now)
    alerts_evaluate(now=now)
    return AlertDelivery.objects.get(event="fired")


def test_it_retries_after_a_500_and_delivers_slack_compatible_json(fired, receiver, now):
    receiver.answer(500, "internal_error")
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "pending"
    fired.refresh_from_db()
    assert (fired.state, fired.attempts, fired.last_error) == ("pending", 1, "HTTP 500 Internal Server Error")
    assert fired.next_attempt_at == later(now, seconds=10)
    assert deliveries_due(now=later(now, seconds=9)) == []  # not before its backoff
    assert delivery_attempt(delivery_id=fired.pk, now=later(now, seconds=9)) is None

    assert deliveries_due(now=later(now, seconds=10)) == [fired.pk]
    assert delivery_attempt(delivery_id=fired.pk, now=later(now, seconds=10)) == "delivered"
    fired.refresh_from_db()
    assert (fired.state, fired.attempts, fired.last_error) == ("delivered", 2, "")
    assert fired.delivered_at == later(now, seconds=10)
    assert deliveries_due(now=later(now, hours=1)) == []

    first, second = receiver.received
    assert first == second  # the same message, fixed when the alert fired
    assert second["text"] == (":rotating_light: *FIRING* Usage without a rate · tier:vlm-lite: 2 requests on "
                              "vlm-lite in the last 60 min were stored without a price (no rate of plan vlm-lite "
                              "in effect): kept unrated, to be priced")
    section, context = second["blocks"]
    assert section["type"] == "section" and section["text"]["type"] == "mrkdwn"
    assert "*FIRING* Usage without a rate" in section["text"]["text"]
    assert context["elements"][0]["text"].startswith("fired ")


def test_it_sends_the_resolution_once_the_condition_clears(fired, receiver, now):
    delivery_attempt(delivery_id=fired.pk, now=now)
    alerts_evaluate(now=later(now, minutes=61))
    resolved = AlertDelivery.objects.get(event="resolved")
    assert delivery_attempt(delivery_id=resolved.pk, now=later(now, minutes=61)) == "delivered"
    assert receiver.received[-1]["text"].startswith(
        ":white_check_mark: *RESOLVED* Usage without a rate · tier:vlm-lite: cleared: no longer seen")
    assert "after 61 min" in receiver.received[-1]["blocks"][1]["elements"][0]["text"]


def test_it_gives_up_after_the_last_attempt_and_says_why(fired, receiver, now):
    at = now
    for attempt in range(1, MAX_ATTEMPTS + 1):
        receiver.answer(503, "upstream unavailable")
        state = delivery_attempt(delivery_id=fired.pk, now=at)
        fired.refresh_from_db()
        assert fired.attempts == attempt
        if attempt < MAX_ATTEMPTS:
            assert state == "pending"
            assert fired.next_attempt_at == later(at, seconds=min(600, 10 * 2 ** (attempt - 1)))
            at = fired.next_attempt_at
    assert state == "failed" and fired.state == "failed"
    assert fired.last_error == f"gave up after {MAX_ATTEMPTS} attempts; last: HTTP 503 Service Unavailable"
    assert len(receiver.received) == MAX_ATTEMPTS
    assert delivery_attempt(delivery_id=fired.pk, now=later(at, hours=1)) is None  # never again
    assert deliveries_due(now=later(at, hours=1)) == []


def test_it_waits_as_long_as_a_429_asks_when_that_is_reasonable(fired, receiver, now):
    receiver.answer(429, "rate_limited", {"Retry-After": "42"})
    delivery_attempt(delivery_id=fired.pk, now=now)
    fired.refresh_from_db()
    assert fired.next_attempt_at == later(now, seconds=42)
    receiver.answer(429, "rate_limited", {"Retry-After": "86400"})  # a day: back off as usual instead
    delivery_attempt(delivery_id=fired.pk, now=fired.next_attempt_at)
    fired.refresh_from_db()
    assert fired.next_attempt_at == later(now, seconds=42 + 20)


def test_an_answer_that_will_not_change_is_not_retried(fired, receiver, now):
    receiver.answer(404, "no_service")  # Slack's answer for a webhook that was removed
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "failed"
    fired.refresh_from_db()
    assert (fired.attempts, fired.last_error) == (1, "HTTP 404 Not Found")


def test_it_retries_a_receiver_that_cannot_be_reached(fired, now):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    fired.webhook.url = f"http://127.0.0.1:{closed}/hook"
    fired.webhook.save()
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "pending"
    fired.refresh_from_db()
    assert fired.last_error.startswith("ConnectError")


def test_it_retries_a_receiver_that_does_not_answer_in_time(fired, receiver, now, monkeypatch):
    import http.server
    import threading

    class Slow(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            # Far past the 0.3 s timeout: a client held off the CPU for a second on a busy
            # machine would otherwise start reading just before the answer came.
            time.sleep(5)
            self.send_response(200)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(delivery_module, "TIMEOUT_S", 0.3)
    try:
        fired.webhook.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        fired.webhook.save()
        assert delivery_attempt(delivery_id=fired.pk, now=now) == "pending"
    finally:
        server.shutdown()
        server.server_close()
    fired.refresh_from_db()
    assert fired.last_error.startswith("timed out after 0.3 s")


def test_a_delivery_being_sent_is_not_sent_again_meanwhile(fired, receiver, now, monkeypatch):
    seen = []

    def post(*, url, payload):
        # While this post is in flight, the sweep and a duplicate task look at the same row.
        seen.append((deliveries_due(now=now), delivery_attempt(delivery_id=fired.pk, now=now)))
        return delivery_module.Outcome(True)

    monkeypatch.setattr(delivery_module, "post", post)
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "delivered"
    assert seen == [([], None)]


def test_a_delivery_claimed_by_a_worker_that_died_is_sent_by_the_sweep(fired, receiver, now):
    AlertDelivery.objects.filter(pk=fired.pk).update(attempts=1, next_attempt_at=later(now, seconds=30))
    assert deliveries_due(now=later(now, seconds=29)) == []
    assert deliveries_due(now=later(now, seconds=30)) == [fired.pk]
    assert delivery_attempt(delivery_id=fired.pk, now=later(now, seconds=30)) == "delivered"


def test_nothing_is_sent_to_a_webhook_disabled_meanwhile(fired, receiver, now):
    fired.webhook.enabled = False
    fired.webhook.save()
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "failed"
    fired.refresh_from_db()
    assert fired.last_error == "not sent: the webhook was disabled" and receiver.received == []


def test_a_committed_alert_is_sent_at_once(world, only_rule, receiver, now, monkeypatch,
                                           django_capture_on_commit_callbacks):
    from controlplane.alerts.tasks import alert_deliver

    monkeypatch.setattr(alert_deliver, "delay", lambda delivery_id: delivery_attempt(delivery_id=delivery_id))
    only_rule(kind="count_disagree", threshold=1)
    WebhookFactory(url=receiver.url)
    usage(tenant=world.alice, tier=world.vision, image_tokens_disagree=True, at=now)
    with django_capture_on_commit_callbacks(execute=True):
        alerts_evaluate()
    assert AlertDelivery.objects.get().state == "delivered"
    assert "*FIRING*" in receiver.texts()[0]


def test_a_test_message_is_posted_to_the_webhook(receiver, db, now):
    webhook = WebhookFactory(name="ops <slack>", url=receiver.url)
    assert webhook_probe(webhook=webhook, now=now).delivered
    (body,) = receiver.received
    assert body["text"].startswith(":wave: Test message from the VLM control plane to webhook ops &lt;slack&gt;")
    receiver.answer(500, "down")
    outcome = webhook_probe(webhook=webhook, now=now)
    assert not outcome.delivered and outcome.error == "HTTP 500 Internal Server Error"


def test_what_a_receiver_answers_is_not_kept_only_its_status(fired, receiver, now):
    receiver.answer(500, "<html>admin console of an internal service</html>")
    delivery_attempt(delivery_id=fired.pk, now=now)
    fired.refresh_from_db()
    assert fired.last_error == "HTTP 500 Internal Server Error"


def test_a_webhook_whose_address_is_not_trusted_is_not_posted_to(fired, receiver, now, settings):
    # Saved while its name pointed elsewhere, say: each post is vetted again.
    settings.OPERATOR_URL_TRUSTED_NETWORKS = []
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "failed"
    fired.refresh_from_db()
    assert fired.last_error.startswith("not sent: webhook URL host '127.0.0.1' resolves to 127.0.0.1, "
                                       "a loopback address")
    assert receiver.received == []


def test_a_redirect_is_not_followed(fired, receiver, now):
    receiver.answer(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
    assert delivery_attempt(delivery_id=fired.pk, now=now) == "failed"
    fired.refresh_from_db()
    assert fired.last_error == "HTTP 302 Found" and len(receiver.received) == 1
