"""Money budgets, a tenant's and a key's: each request reserves the most it can cost (its
output at max_tokens) in the same atomic step as the token quotas, and settles to what it cost
when it ends, so concurrent requests never spend past a hard budget. Held in both ledgers."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.gateway.ledger import Ask, Limits, Refused
from controlplane.metering.models import UsageEvent
from controlplane.metering.rating import Rates
from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota
from controlplane.tenants.services import api_key_create

pytestmark = pytest.mark.accounting  # also run in embedded mode (SQLite, no Redis)

# The test world's prices: text 0.20, images 0.30, output 0.60 a million tokens, 0.001 an image.
RATES = Rates(text_input_per_mtok=Decimal("0.20"), image_per_mtok=Decimal("0.30"), output_per_mtok=Decimal("0.60"),
              per_image_fee=Decimal("0.001"), cached_image_discount=Decimal("0.5"))
# 100 text tokens and at most 1,000 out: 20 + 600 micro-units at most; 5 out: 20 + 3.
WORST, REAL = 620, 23


def _record(world, n: int, key_id: int | None = None) -> UsageRecord:
    return UsageRecord(request_id=f"req-budget-{n}", tenant_id=world.alice.pk, api_key_id=key_id,
                       tier_id=world.text.pk, text_tokens=100)


def _ask(key_id: int | None = None) -> Ask:
    return Ask(image_tokens=0, total_tokens=1100, large=False, cost=WORST, key_id=key_id, rates=RATES)


def _burst(world, limits: Limits, count: int, key_id: int | None = None) -> list:
    async def burst():
        records = [_record(world, n, key_id) for n in range(count)]
        return await asyncio.gather(*(ledger.admit(r, limits, _ask(key_id)) for r in records), return_exceptions=True)
    return async_to_sync(burst)()


@pytest.mark.django_db(transaction=True)
def test_500_concurrent_requests_never_spend_past_a_hard_budget(world, mode):  # noqa: F811
    limits = Limits(spend=WORST * 120)
    outcomes = _burst(world, limits, 500)
    admitted = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Refused)]
    assert len(admitted) == 120 and len(refused) == 380  # none failed, none past the budget
    assert {r.limit for r in refused} == {"spend"}
    assert "budget exceeded: the tenant's budget of 0.07 USD this month is spent" in str(refused[0])
    current_process().ledger_book.live.clear()


@pytest.mark.django_db(transaction=True)
def test_a_keys_budget_holds_its_key_and_not_the_tenants_other_keys(world, mode):  # noqa: F811
    capped = api_key_create(tenant=world.alice, name="capped").api_key
    other = api_key_create(tenant=world.alice, name="other").api_key
    limits = Limits(key_spend=WORST * 3)
    outcomes = _burst(world, limits, 10, key_id=capped.pk)
    assert sum(not isinstance(o, Exception) for o in outcomes) == 3
    assert {o.limit for o in outcomes if isinstance(o, Refused)} == {"key_spend"}
    async def another():
        return await ledger.admit(_record(world, 99, other.pk), limits, _ask(other.pk))
    assert async_to_sync(another)()  # the tenant's other key spends on
    current_process().ledger_book.live.clear()


@pytest.mark.django_db(transaction=True)
def test_a_finished_request_holds_what_it_cost_not_its_worst_case(world, mode):  # noqa: F811
    """Five requests reserve their worst case, 3,100 of a 3,300 budget: a sixth is refused.
    Each ends having cost 23: 2,985 is free again, and five more fit."""
    limits = Limits(spend=3300)

    async def round_trip():
        flights = [await ledger.admit(_record(world, n), limits, _ask()) for n in range(5)]
        with pytest.raises(Refused):
            await ledger.admit(_record(world, 5), limits, _ask())
        for flight in flights:
            flight.record.output_tokens, flight.record.instance_id = 5, None
            await ledger.finish(flight.record)
        return [await ledger.admit(_record(world, 10 + n), limits, _ask()) for n in range(5)]

    assert len(async_to_sync(round_trip)()) == 5
    costs = [event.cost for event in stored_events(mode)]
    assert costs == [Decimal("0.000023")] * 5  # billed what the budget settled to
    current_process().ledger_book.live.clear()


def stored_events(mode):
    if mode == "redis":
        from controlplane.metering.outbox import usage_ingest

        usage_ingest()
    return list(UsageEvent.objects.order_by("request_id"))


@pytest.mark.django_db(transaction=True)
def test_a_budget_counts_what_was_spent_before_its_counters_started(world, mode):  # noqa: F811
    """A period's counters start from what is metered: spend billed earlier this month counts."""
    spent = _record(world, 0)
    spent.output_tokens, spent.created_at = 50_000, timezone.now()  # 0.03002
    usage_record(record=spent)
    limits = Limits(spend=30_020 + WORST - 1)

    async def admit():
        return await ledger.admit(_record(world, 1), limits, _ask())
    with pytest.raises(Refused) as refused:
        async_to_sync(admit)()
    assert refused.value.limit == "spend"


def _send(client, secret, max_tokens=5):
    body = json.dumps({"model": "text", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    return client.post("/v1/chat/completions", data=body, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {secret}")


@pytest.mark.django_db(transaction=True)
def test_the_gateway_refuses_a_spent_budget_with_budget_exceeded_and_serves_a_soft_one(client, routed,
                                                                                      ledger_mode):  # noqa: F811
    from controlplane.gateway import state

    spent = _record(routed, 0)
    spent.output_tokens = 20_000  # 0.012 USD this month
    usage_record(record=spent)
    quota = Quota.objects.create(tenant=routed.alice, spend_limit=Decimal("0.01"))
    refused = _send(client, routed.alice_key)
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded" and "budget of 0.01 USD this month is spent" in error["message"]
    assert _send(client, routed.bob_key).status_code == 200  # another tenant's budget is its own

    quota.spend_hard = False
    quota.save()
    state.clear_caches()
    assert _send(client, routed.alice_key).status_code == 200  # soft: alerted on, never refused


@pytest.mark.django_db(transaction=True)
def test_a_request_whose_worst_case_does_not_fit_is_refused_before_the_engine_works(client, routed,
                                                                                   ledger_mode):  # noqa: F811
    """With 0.0005 USD left, room for a short answer is not room for one of up to 1,000 tokens
    (0.0006 USD)."""
    spent = _record(routed, 0)
    spent.output_tokens = 15_800  # 0.0095 USD this month
    usage_record(record=spent)
    Quota.objects.create(tenant=routed.alice, spend_limit=Decimal("0.01"))
    assert _send(client, routed.alice_key, max_tokens=1000).json()["error"]["code"] == "budget_exceeded"
    assert _send(client, routed.alice_key, max_tokens=100).status_code == 200
