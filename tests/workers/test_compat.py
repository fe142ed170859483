from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance, Node
from workers.supervision import compat, engine_check

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("text, expected", [("0.11.0", (0, 11, 0)), ("v0.8.5.post1", (0, 8, 5)),
                                            ("0.12.0rc2.dev5+gabc", (0, 12, 0)), ("1.0", (1, 0))])
def test_versions_are_read_by_their_release_numbers(text, expected):
    assert compat.version_tuple(text) == expected


def _vllm_tier(world, family="qwen2_5_vl", **settings):
    tier = world.vision
    tier.engine_kind, tier.family, tier.engine_settings = "vllm", family, {**tier.engine_settings, **settings}
    tier.save()
    return tier


@pytest.mark.parametrize("installed, family, refused", [
    ("", "qwen2_5_vl", "not installed"),
    ("0.6.3", "qwen2_5_vl", "needs vLLM 0.7.2"),
    ("0.10.1", "qwen3_vl", "needs vLLM 0.11.0"),
    ("0.11.0", "qwen3_vl", None),
    ("0.33.0", "gemma3", None),
])
def test_a_launch_that_cannot_work_is_refused_with_the_reason(world, installed, family, refused):
    node = Node(name="gpu-a", vllm_version=installed)
    reason = compat.launch_refusal(_vllm_tier(world, family), node)
    assert (reason is None) if refused is None else (refused in reason)


def test_flags_newer_than_the_node_are_refused(world):
    tier = _vllm_tier(world, allowed_media_domains=["cdn.example.com"])
    assert "--allowed-media-domains needs vLLM" in compat.launch_refusal(tier, Node(name="n", vllm_version="0.10.2"))


def test_the_refusal_lands_on_the_instance_row_and_nothing_is_started(world):
    tier = _vllm_tier(world)
    node = Node.objects.create(name="gpu-old", queue="node.gpu-old", vllm_version="0.6.0", last_seen_at=timezone.now())
    instance = EngineInstance.objects.create(tier=tier, node=node)
    engine_check(EngineInstance.objects.select_related("tier", "node").get(pk=instance.pk), timezone.now())
    instance.refresh_from_db()
    assert instance.actual_state == "failed" and instance.pid is None
    assert "needs vLLM 0.7.2 or newer; node gpu-old has 0.6.0" in instance.state_reason
    assert instance.events.filter(to_state="failed").exists()


def test_every_family_we_count_tokens_for_has_a_vllm_architecture():
    from controlplane.imaging.tokens import FAMILIES

    assert set(FAMILIES) <= set(compat.ARCHITECTURES)
    assert ModelTier.EngineKind.EXTERNAL == "external"


@pytest.mark.parametrize("installed, device, refused", [
    ("0.32.0+cpu", "cpu", None),
    ("0.32.0+cpu", "gpu", "cannot serve a GPU tier"),
    ("0.33.0", "cpu", "has a GPU build of vLLM"),
    ("", "cpu", "workers.engines.cpu.install"),
])
def test_a_cpu_tier_needs_vllms_cpu_build_and_a_gpu_tier_the_gpu_build(world, installed, device, refused):
    reason = compat.launch_refusal(_vllm_tier(world, device=device), Node(name="n", vllm_version=installed))
    assert (reason is None) if refused is None else (refused in reason)


def test_a_cpu_tier_is_placed_on_a_node_without_gpus(world):
    from controlplane.fleet.services import instances_place

    tier = _vllm_tier(world, device="cpu")
    node = Node.objects.create(name="cpu-a", queue="node.cpu-a", vllm_version="0.32.0+cpu",
                               last_seen_at=timezone.now())
    instance = EngineInstance.objects.create(tier=tier)
    assert instances_place() == 1
    instance.refresh_from_db()
    assert instance.node == node and not instance.gpus.exists()
