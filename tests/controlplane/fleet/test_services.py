from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineEvent, EngineInstance, Node
from controlplane.fleet.selectors import routable_instances
from controlplane.fleet.services import instances_place, node_register, tier_replicas_sync

pytestmark = pytest.mark.django_db


def _gpu_tier(world, name="vlm-big", replicas=1, tp=1):
    return ModelTier.objects.create(
        name=name, family="qwen2_5_vl", model_id="Qwen/Qwen2.5-VL-72B-Instruct", kind="vision",
        engine_kind="vllm", engine_settings={"tensor_parallel_size": tp}, replicas=replicas,
        gpus_per_replica=tp, resolution_policy=world.vision.resolution_policy,
        price_plan=world.vision.price_plan)


def test_a_node_registers_its_gpus_and_forgets_removed_ones():
    node = node_register(name="gpu-a", address="10.0.0.5",
                         gpus=[{"index": 0, "model": "H100", "memory_mib": 81559},
                               {"index": 1, "model": "H100", "memory_mib": 81559}])
    assert node.queue == "node.gpu-a"
    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0, "model": "H100"}])
    assert list(node.gpus.values_list("index", flat=True)) == [0]


def test_replicas_are_created_once(world):
    tier = _gpu_tier(world, replicas=3)
    tier_replicas_sync()
    tier_replicas_sync()
    assert tier.instances.count() == 3


def test_one_gpu_is_never_given_to_two_engines(world):
    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0}, {"index": 1}, {"index": 2}])
    tier = _gpu_tier(world, replicas=2, tp=2)
    tier_replicas_sync()
    instances_place()
    assert tier.instances.exclude(node=None).count() == 1  # 3 GPUs fit one TP-2 engine, not two
    placed = tier.instances.exclude(node=None).get()
    assert sorted(placed.gpus.values_list("index", flat=True)) == [0, 1]
    assert tier.instances.filter(node=None).count() == 1

    node_register(name="gpu-b", address="10.0.0.6", gpus=[{"index": 0}, {"index": 1}])
    instances_place()
    assert tier.instances.filter(node=None).count() == 0
    everyone = [g for i in tier.instances.all() for g in i.gpus.all()]
    assert len(everyone) == len(set(everyone)) == 4
    assert EngineEvent.objects.filter(reason__startswith="placed on gpu-b").exists()


def test_nodes_not_seen_lately_get_no_new_engines(world):
    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0}])
    Node.objects.update(last_seen_at=timezone.now() - dt.timedelta(minutes=5))
    tier = _gpu_tier(world)
    tier_replicas_sync()
    instances_place()
    assert not EngineInstance.objects.exclude(node=None).exists()
    assert tier.instances.count() == 1


def test_only_fresh_healthy_running_instances_are_routable(world):
    node = node_register(name="local", address="127.0.0.1", gpus=[])
    now = timezone.now()
    fields = {"tier": world.vision, "node": node, "port": 9000, "healthy": True, "last_health_at": now,
              "actual_state": "running"}
    good = EngineInstance.objects.create(**fields)
    EngineInstance.objects.create(**{**fields, "port": 9001, "healthy": False})
    EngineInstance.objects.create(**{**fields, "port": 9002, "last_health_at": now - dt.timedelta(minutes=2)})
    EngineInstance.objects.create(**{**fields, "port": 9003, "desired_state": "stopped"})
    EngineInstance.objects.create(**{**fields, "port": 9004, "actual_state": "starting"})
    assert [i.pk for i in routable_instances(tier_id=world.vision.pk)] == [good.pk]


def test_healthy_engines_stay_routable_while_supervision_itself_is_cut_off(world):
    """The broker down: no node agent reports, every health check goes stale at once. The
    engines are not the problem, so those last found healthy keep serving."""
    node = node_register(name="local", address="127.0.0.1", gpus=[])
    checked = timezone.now() - dt.timedelta(minutes=3)  # the last round before the broker went away
    fields = {"tier": world.vision, "node": node, "healthy": True, "last_health_at": checked,
              "actual_state": "running"}
    healthy = EngineInstance.objects.create(**fields, port=9000)
    EngineInstance.objects.create(**{**fields, "healthy": False}, port=9001)
    assert [i.pk for i in routable_instances(tier_id=world.vision.pk)] == [healthy.pk]
    # One engine checked just now: supervision runs, so the stale one is stale for a reason.
    EngineInstance.objects.create(**{**fields, "last_health_at": timezone.now(), "tier": world.text}, port=9002)
    assert routable_instances(tier_id=world.vision.pk) == []


def test_a_draining_engine_keeps_its_gpu_until_it_has_stopped(world):
    from controlplane.fleet.services import instance_action

    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0}])
    tier = _gpu_tier(world)
    tier_replicas_sync()
    instances_place()
    serving = tier.instances.get()
    EngineInstance.objects.filter(pk=serving.pk).update(actual_state="running", pid=4242)  # alive
    instance_action(instance=EngineInstance.objects.get(pk=serving.pk), action="drain", user=None, replace=True)
    tier_replicas_sync()  # a replacement is wanted at once
    instances_place()
    replacement = tier.instances.exclude(pk=serving.pk).get()
    assert replacement.node is None and not replacement.gpus.exists()  # GPU 0 is still held

    EngineInstance.objects.filter(pk=serving.pk).update(actual_state="stopped", pid=None)
    instances_place()
    assert list(tier.instances.get(pk=replacement.pk).gpus.values_list("index", flat=True)) == [0]


def test_relaunching_an_instance_that_lost_its_gpu_places_it_afresh(world):
    from controlplane.fleet.services import instance_action

    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0}])
    tier = _gpu_tier(world)
    tier_replicas_sync()
    instances_place()
    first = tier.instances.get()
    instance_action(instance=first, action="stop", user=None, replace=True)
    tier_replicas_sync()
    instances_place()  # the replacement takes GPU 0
    instance_action(instance=EngineInstance.objects.get(pk=first.pk), action="launch", user=None)
    holders = [i for i in tier.instances.filter(desired_state="running") if i.gpus.filter(index=0).exists()]
    assert len(holders) == 1  # never two engines on one GPU


def test_instances_of_a_lost_node_are_placed_again_elsewhere(world):
    node_register(name="gpu-a", address="10.0.0.5", gpus=[{"index": 0}])
    tier = _gpu_tier(world)
    tier_replicas_sync()
    instances_place()
    Node.objects.filter(name="gpu-a").update(last_seen_at=timezone.now() - dt.timedelta(minutes=5))
    node_register(name="gpu-b", address="10.0.0.6", gpus=[{"index": 0}])
    instances_place()
    instance = tier.instances.get()
    assert instance.node.name == "gpu-b"
    assert EngineEvent.objects.filter(instance=instance, reason__contains="gpu-a not seen").exists()


def test_an_external_engine_is_registered_only_where_the_control_plane_may_call(world, settings):
    from django.core.exceptions import ValidationError

    from controlplane.fleet.services import FleetActionRefused, external_engine_register

    tier = ModelTier.objects.create(name="vlm-ext", family="qwen2_5_vl", model_id="m", kind="vision",
                                    engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    with pytest.raises(FleetActionRefused, match="engine URL host '10.0.0.7' resolves to 10.0.0.7, a private address"):
        external_engine_register(tier=tier, url="http://10.0.0.7:8000", actor="olivia")
    with pytest.raises(FleetActionRefused, match="is not an http"):
        external_engine_register(tier=tier, url="gopher://10.0.0.7", actor="olivia")
    with pytest.raises(ValidationError, match="a private address"):  # the admin's path
        EngineInstance(tier=tier, external_url="http://10.0.0.7:8000").full_clean()
    assert not EngineInstance.objects.filter(tier=tier).exists()
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["10.0.0.0/24"]
    instance = external_engine_register(tier=tier, url="http://10.0.0.7:8000", actor="olivia")
    assert instance.events.get().reason == "registered at http://10.0.0.7:8000 serving vlm-ext by olivia"
