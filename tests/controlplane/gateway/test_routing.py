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


def test_an_engine_that_saw_the_picture_is_preferred_within_the_slack(engines_seen):
    engines = [spec(1), spec(2)]
    engines_seen.remember(("picture",), 2)
    engines_seen.outstanding[2] = routing.AFFINITY_SLACK
    assert all(engines_seen.choose(engines, images=("picture",)).id == 2 for _ in range(20))
    engines_seen.outstanding[2] = routing.AFFINITY_SLACK + 1  # too busy: the warm cache is not worth the wait
    assert engines_seen.choose(engines, images=("picture",)).id == 1


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
