from __future__ import annotations

import pytest

from controlplane.gateway import routing
from controlplane.gateway.state import InstanceSpec


def spec(id, pool="standard", queued=0.0):
    return InstanceSpec(id=id, tier_id=1, base_url=f"http://e{id}", pool=pool, queued=queued)


@pytest.fixture
def engines_seen():
    return routing.EngineLoads()


def test_large_requests_go_to_the_large_pool_and_nothing_else_does(engines_seen):
    engines = [spec(1), spec(2), spec(3, "large")]
    assert engines_seen.choose(engines, large=True).id == 3
    assert {engines_seen.choose(engines).id for _ in range(50)} == {1, 2}
    assert routing.has_dedicated_large_pool(engines)


def test_without_a_large_pool_large_requests_share_the_standard_engines(engines_seen):
    assert engines_seen.choose([spec(1), spec(2)], large=True).id in (1, 2)
    assert engines_seen.choose([spec(3, "large")]) is None  # small requests never take the large pool


def test_the_least_loaded_engine_wins_counting_its_own_queue(engines_seen):
    engines_seen.outstanding[1] = 3
    assert engines_seen.choose([spec(1), spec(2, queued=2)]).id == 2
    assert engines_seen.choose([spec(1), spec(2, queued=5)]).id == 1


def test_every_replica_sends_a_picture_to_the_same_engine_while_it_is_within_the_slack():
    engines = [spec(n) for n in range(1, 5)]
    one, other = routing.EngineLoads(), routing.EngineLoads()  # two replicas that never talk
    pictures = [f"1:picture-{n}" for n in range(200)]
    chosen = [one.choose(engines, images=(p,)).id for p in pictures]
    assert chosen == [other.choose(engines, images=(p,)).id for p in pictures]
    assert len(set(chosen)) == 4  # spread over every engine
    favourite = chosen[0]
    other.outstanding[favourite] = routing.AFFINITY_SLACK
    assert other.choose(engines, images=(pictures[0],)).id == favourite
    other.outstanding[favourite] = routing.AFFINITY_SLACK + 1  # too busy: the warm cache is not worth the wait
    assert other.choose(engines, images=(pictures[0],)).id != favourite


def test_an_engine_leaving_moves_only_the_pictures_it_had():
    engines = [spec(n) for n in range(1, 5)]
    loads = routing.EngineLoads()
    pictures = [f"1:picture-{n}" for n in range(1000)]
    before = {p: loads.choose(engines, images=(p,)).id for p in pictures}
    after = {p: loads.choose([e for e in engines if e.id != 3], images=(p,)).id for p in pictures}
    moved = [p for p in pictures if before[p] != after[p]]
    assert moved and all(before[p] == 3 for p in moved)
    assert all(150 < list(before.values()).count(n) < 350 for n in range(1, 5))


def test_least_outstanding_counts_every_replicas_requests_in_flight(settings):
    import uuid

    from asgiref.sync import async_to_sync

    from tests.conftest import skip_without_redis

    skip_without_redis()
    prefix = f"loads-{uuid.uuid4().hex}"
    one = routing.EngineLoads(routing.SharedLoads(settings.REDIS_URL, prefix))
    other = routing.EngineLoads(routing.SharedLoads(settings.REDIS_URL, prefix))
    engines = [spec(1), spec(2)]
    one.outstanding[1] = 5  # one replica's requests on engine 1

    @async_to_sync
    async def share():
        await one.shared.exchange(one)
        await other.shared.exchange(other)

    share()
    assert other.others == {1: 5}
    assert all(other.choose(engines).id == 2 for _ in range(20))  # the other replica sees them
    assert all(one.choose(engines).id == 2 for _ in range(20))


def test_excluded_engines_are_skipped_and_none_left_means_none(engines_seen):
    assert engines_seen.choose([spec(1), spec(2)], exclude={1}).id == 2
    assert engines_seen.choose([spec(1)], exclude={1}) is None


@pytest.mark.django_db
def test_a_tier_gets_its_large_image_pool_replicas(world):
    from controlplane.fleet.services import tier_replicas_sync

    world.vision.engine_settings = {**world.vision.engine_settings, "large_pool_replicas": 2}
    world.vision.save()
    tier_replicas_sync()
    tier_replicas_sync()
    assert sorted(world.vision.instances.values_list("pool", flat=True)) == ["large", "large", "standard"]


def test_a_flood_of_unknown_keys_does_not_flush_the_known_ones():
    from controlplane.gateway.ttl_cache import TTLCache

    cache = TTLCache(60, max_items=100)
    cache.put("valid", "tenant")
    for n in range(1000):
        if n % 50 == 0:
            cache.put("valid", "tenant")  # in use: refreshed
        cache.put(f"random-{n}", None)
    assert cache.get("valid") == "tenant"
    assert len(cache._items) <= 100
