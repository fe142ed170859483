"""Image prefill slots: an engine's image requests between dispatch and first token are capped,
across every gateway replica, handed round the tenants waiting, and never leaked."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings

from controlplane.gateway.errors import GatewayError
from controlplane.gateway.prefill import Ask, LocalSlots, PrefillSlots, RedisSlots
from tests.conftest import skip_without_redis

TIER = 7


@pytest.fixture(params=["redis", "local"])
def replicas(request):
    """Two gateway replicas' ways to the slots: over one Redis, as deployed, or (embedded mode)
    the one process's own slots; `replicas(lease_s=...)` makes them."""
    made = []

    def make(lease_s: float = 60):
        if request.param == "redis":
            skip_without_redis()
            prefix = f"prefill-{uuid.uuid4().hex}"
            made.append(prefix)
            return (PrefillSlots(RedisSlots(settings.REDIS_URL, prefix, lease_s=lease_s)),
                    PrefillSlots(RedisSlots(settings.REDIS_URL, prefix, lease_s=lease_s)))
        store = LocalSlots(lease_s=lease_s)
        return PrefillSlots(store), PrefillSlots(store)

    yield make
    for prefix in made:
        client = redis.Redis.from_url(settings.REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


def ask(holder: str, *, tenant: int = 1, engines=(1,), per_engine: int = 1, large: bool = False, large_slots=1,
        patience_ms: int = 0):
    return Ask(tier_id=TIER, tenant_id=tenant, holder=holder, engines=tuple(engines), per_engine=per_engine,
               large=large, large_slots=large_slots, patience_ms=patience_ms)


def test_an_engine_prefills_at_most_its_slots_of_image_requests_whatever_the_replica(replicas):
    one, other = replicas()

    @async_to_sync
    async def scenario():
        held = [await one.take(ask("a", per_engine=2), wait_s=1), await other.take(ask("b", per_engine=2), wait_s=1)]
        waiting = asyncio.ensure_future(one.take(ask("c", per_engine=2), wait_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done() and await one.store.holders(TIER, 1) == 2  # the third waits
        await held[1].release()  # freed by the other replica
        third = await asyncio.wait_for(waiting, 2)
        assert third.engine == 1 and await other.store.holders(TIER, 1) == 2
        for slot in (held[0], third):
            await slot.release()
        return await one.store.holders(TIER, 1)

    assert scenario() == 0


def test_a_waiting_image_request_takes_whichever_of_its_engines_frees_a_slot_first(replicas):
    one, other = replicas()

    @async_to_sync
    async def scenario():
        first = await one.take(ask("a", engines=(1,)), wait_s=1)
        second = await other.take(ask("b", engines=(2,)), wait_s=1)
        waiting = asyncio.ensure_future(one.take(ask("c", engines=(1, 2)), wait_s=5))
        await asyncio.sleep(0.1)
        await second.release()
        taken = await asyncio.wait_for(waiting, 2)
        await first.release()
        await taken.release()
        return taken.engine

    assert scenario() == 2  # its preferred engine stayed busy


def test_an_image_request_waits_a_little_for_the_engine_that_has_its_picture_cached(replicas):
    one, other = replicas()

    @async_to_sync
    async def scenario():
        warm = await one.take(ask("warm", engines=(1,)), wait_s=1)
        # Engine 2 is free, but engine 1 has the picture: it is worth a short wait...
        waiting = asyncio.ensure_future(other.take(ask("next-turn", engines=(1, 2), patience_ms=2000), wait_s=5))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await warm.release()
        back = await asyncio.wait_for(waiting, 2)
        await back.release()
        # ...and past the patience, any engine with a slot will do.
        started = asyncio.get_running_loop().time()
        hold = await one.take(ask("busy", engines=(1,)), wait_s=1)
        elsewhere = await other.take(ask("impatient", engines=(1, 2), patience_ms=300), wait_s=5)
        waited = asyncio.get_running_loop().time() - started
        for slot in (hold, elsewhere):
            await slot.release()
        return back.engine, elsewhere.engine, waited

    back, elsewhere, waited = scenario()
    assert (back, elsewhere) == (1, 2) and 0.25 < waited < 2


def test_freed_slots_go_round_the_tenants_waiting(replicas):
    one, other = replicas()
    order = []

    @async_to_sync
    async def scenario():
        holding = await one.take(ask("held", tenant=1), wait_s=1)

        async def request(slots, tenant, n):
            slot = await slots.take(ask(f"{tenant}-{n}", tenant=tenant), wait_s=10)
            order.append((tenant, n))
            await asyncio.sleep(0.02)
            await slot.release()

        burst = [asyncio.ensure_future(request(one, 1, n)) for n in range(5)]  # tenant 1 queues five
        await asyncio.sleep(0.1)
        late = asyncio.ensure_future(request(other, 2, 0))  # tenant 2 comes after, on another replica
        await asyncio.sleep(0.1)
        await holding.release()
        await asyncio.wait_for(asyncio.gather(*burst, late), 10)

    scenario()
    assert order.index((2, 0)) <= 1  # served after at most one of the burst, not after all five
    assert [n for tenant, n in order if tenant == 1] == [0, 1, 2, 3, 4]  # each tenant's in order


def test_a_wait_that_runs_out_is_a_429_with_retry_after_and_leaves_nothing_behind(replicas):
    one, other = replicas()

    @async_to_sync
    async def scenario():
        holding = await one.take(ask("held"), wait_s=1)
        with pytest.raises(GatewayError) as refused:
            await other.take(ask("late", tenant=2), wait_s=0.2)
        await holding.release()
        after = await asyncio.wait_for(one.take(ask("next", tenant=3), wait_s=1), 0.5)  # nobody left queued
        await after.release()
        return refused.value, await one.store.holders(TIER, 1)

    refused, holders = scenario()
    assert refused.status == 429 and refused.headers["Retry-After"] and refused.code == "rate_limit_exceeded"
    assert holders == 0


def test_a_request_gone_while_waiting_leaves_no_slot_and_no_place_in_the_queue(replicas):
    one, _ = replicas()

    @async_to_sync
    async def scenario():
        holding = await one.take(ask("held"), wait_s=1)
        gone = asyncio.ensure_future(one.take(ask("gone", tenant=2), wait_s=10))
        await asyncio.sleep(0.1)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        await holding.release()
        await asyncio.sleep(0.05)
        holders_after = await one.store.holders(TIER, 1)
        nxt = await asyncio.wait_for(one.take(ask("next", tenant=3), wait_s=1), 0.5)
        await nxt.release()
        return holders_after

    assert scenario() == 0


def test_a_replica_that_dies_holding_a_slot_loses_it_when_its_lease_ends(replicas):
    dead, alive = replicas(lease_s=1)

    @async_to_sync
    async def scenario():
        await dead.take(ask("never-released"), wait_s=1)  # its replica dies: nobody releases it
        started = asyncio.get_running_loop().time()
        slot = await alive.take(ask("after", tenant=2), wait_s=5)
        waited = asyncio.get_running_loop().time() - started
        await slot.release()
        return waited

    assert 0.5 < scenario() < 3


def test_large_images_share_the_tiers_large_image_slots_across_its_engines(replicas):
    one, other = replicas()

    @async_to_sync
    async def scenario():
        large = await one.take(ask("large-1", engines=(1, 2), per_engine=2, large=True), wait_s=1)
        second_large = asyncio.ensure_future(
            other.take(ask("large-2", tenant=2, engines=(2, 1), per_engine=2, large=True), wait_s=5))
        small = await asyncio.wait_for(other.take(ask("small", tenant=3, engines=(2,), per_engine=2), wait_s=5), 1)
        await asyncio.sleep(0.1)
        waited = not second_large.done()  # engine 2 has slots, but the tier's one large slot is taken
        await large.release()
        later = await asyncio.wait_for(second_large, 2)
        for slot in (small, later):
            await slot.release()
        return waited, small.engine

    assert scenario() == (True, 2)


def test_slots_that_cannot_be_reached_are_a_503_with_retry_after():
    slots = PrefillSlots(RedisSlots("redis://127.0.0.1:1/0", "unreachable", lease_s=60))

    @async_to_sync
    async def scenario():
        with pytest.raises(GatewayError) as refused:
            await slots.take(ask("a"), wait_s=1)
        return refused.value

    refused = scenario()
    assert refused.status == 503 and refused.headers["Retry-After"]
