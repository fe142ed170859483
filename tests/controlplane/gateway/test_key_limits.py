"""An API key may carry a requests-per-minute limit of its own, within its tenant's quota: a
tenant admin caps one app's key without capping the others. Held in both ledgers."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.gateway.ledger import ledger
from controlplane.tenants.services import api_key_create

pytestmark = pytest.mark.accounting  # also run in embedded mode (SQLite, no Redis)


def test_a_keys_own_limit_refuses_past_it_and_counts_nothing_it_refuses(world, mode):  # noqa: F811
    key = api_key_create(tenant=world.alice, requests_per_minute=2).api_key
    other = api_key_create(tenant=world.alice, requests_per_minute=2).api_key
    now = dt.datetime(2026, 12, 1, 12, 30, 5, tzinfo=dt.UTC)
    rate = async_to_sync(ledger().key_rate)
    assert [rate(key.pk, 2, now) for _ in range(4)] == [True, True, False, False]
    assert rate(other.pk, 2, now)  # another key of the same tenant is not held by it
    assert rate(key.pk, 2, now + dt.timedelta(minutes=1))  # a new minute starts afresh


@pytest.mark.django_db
def test_the_gateway_answers_429_with_retry_after_past_a_keys_own_limit(client, routed):  # noqa: F811
    body = json.dumps({"model": "text", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})

    def send(secret):
        return client.post("/v1/chat/completions", data=body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {secret}")

    for attempt in range(3):  # both in one minute (a minute that turns between them starts afresh)
        # A key of its own each attempt: a second request counted in the minute that turned
        # would refuse the next attempt's first (as CI once saw).
        capped = api_key_create(tenant=routed.alice, name=f"capped-{attempt}", requests_per_minute=1).secret
        minute = timezone.now().replace(second=0, microsecond=0)
        first, second = send(capped), send(capped)
        if timezone.now().replace(second=0, microsecond=0) == minute:
            break
    assert first.status_code == 200
    assert second.status_code == 429 and int(second["Retry-After"]) >= 1
    error = second.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "this API key's limit exceeded: 1 requests" in error["message"]
    assert send(routed.alice_key).status_code == 200  # the tenant's other key is not held by it


@pytest.mark.django_db(transaction=True)
def test_a_request_the_tenants_quota_refuses_does_not_use_the_keys_own_minute(client, routed, ledger_mode):  # noqa: F811
    """Counted against the key's limit first, then refused by the tenant's quota: the key's
    request is given back, as the tenant's own per-minute count never took it."""
    from controlplane.tenants.models import Quota

    capped = api_key_create(tenant=routed.alice, name="capped", requests_per_minute=1).secret
    quota = Quota.objects.create(tenant=routed.alice, period="day", total_tokens=5)  # far too few
    body = json.dumps({"model": "text", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})

    def send():
        return client.post("/v1/chat/completions", data=body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {capped}")

    for _attempt in range(3):  # both in one minute
        minute = timezone.now().replace(second=0, microsecond=0)
        refused = send()
        quota.total_tokens = 10**6
        quota.save()
        from controlplane.gateway import state

        state.clear_caches()  # the key's limits, read afresh
        admitted = send()
        if timezone.now().replace(second=0, microsecond=0) == minute:
            break
        quota.total_tokens = 5
        quota.save()
        state.clear_caches()
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "insufficient_quota")
    assert admitted.status_code == 200  # the key's one request this minute was not used up
