"""An enabled tier that no engine serves answers every request 503: an alert says so once it
has lasted the rule's threshold, and resolves when an engine serves it again."""

from __future__ import annotations

import pytest

from controlplane.alerts.models import Alert
from controlplane.alerts.services import alerts_evaluate
from controlplane.fleet.models import EngineEvent, EngineInstance, Node
from tests.controlplane.alerts.conftest import later

pytestmark = pytest.mark.django_db


def firing():
    return list(Alert.objects.filter(state=Alert.State.FIRING).order_by("subject"))


def _serving(tier, now):
    node, _ = Node.objects.get_or_create(name="gpu-1", defaults={"queue": "node.gpu-1"})
    return EngineInstance.objects.create(tier=tier, node=node, port=8001, actual_state="running", healthy=True,
                                         last_health_at=now)


def test_a_tier_whose_engine_crashed_fires_after_the_threshold_and_resolves_when_served(world, only_rule, now):
    only_rule(kind="tier_unserved", threshold=120)
    world.text.enabled = False
    world.text.save()
    engine = _serving(world.vision, now)
    assert alerts_evaluate(now=now).fired == 0

    engine.actual_state, engine.healthy = "crashed", False
    engine.save()
    EngineEvent.objects.create(instance=engine, from_state="running", to_state="crashed", reason="exit 1",
                               created_at=later(now, seconds=5))
    assert alerts_evaluate(now=later(now, seconds=60)).fired == 0  # within the 120 s allowed
    assert alerts_evaluate(now=later(now, seconds=126)).fired == 1
    (alert,) = firing()
    assert alert.subject == f"tier:{world.vision.name}" and alert.value == 121
    assert alert.message == (f"{world.vision.name} has had no engine serving it for 121 s (1 crashed); "
                             "its requests are answered 503")

    engine.actual_state, engine.healthy, engine.last_health_at = "running", True, later(now, seconds=150)
    engine.save()
    assert alerts_evaluate(now=later(now, seconds=150)).resolved == 1
    assert Alert.objects.get().resolution == f"cleared: {world.vision.name} is served by 1 engine"


def test_an_enabled_tier_with_no_engine_at_all_fires_at_once_and_a_disabled_one_never(world, only_rule, now):
    only_rule(kind="tier_unserved", threshold=120)
    _serving(world.vision, now)
    world.text.enabled = True
    world.text.save()
    assert alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert alert.message == f"{world.text.name} is enabled and has no engine to serve it; its requests are answered 503"

    world.text.enabled = False
    world.text.save()
    assert alerts_evaluate(now=later(now, seconds=30)).resolved == 1


def test_an_engine_healthy_but_no_longer_checked_leaves_its_tier_unserved(world, only_rule, now):
    # A node agent that stopped reporting while others still do: the engine is out of rotation.
    only_rule(kind="tier_unserved", threshold=120, tier=world.vision)
    stale = _serving(world.vision, later(now, minutes=-10))
    other = EngineInstance.objects.create(tier=world.text, node=stale.node, port=8002, actual_state="running",
                                          healthy=True, last_health_at=now)
    assert other.pk and alerts_evaluate(now=now).fired == 1
    (alert,) = firing()
    assert alert.subject == f"tier:{world.vision.name}" and alert.value == 600
