"""The `vllm serve` command lines of the demo tiers, checked flag by flag against vLLM's
documented flags (tests/workers/vllm_flags.py)."""

from __future__ import annotations

import pytest

from controlplane.catalog.demo import seed_demo
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance, Gpu, Node
from tests.workers.vllm_flags import check
from workers.engines.launch import build_command
from workers.supervision import launch_spec

pytestmark = pytest.mark.django_db


@pytest.fixture
def gpu_instances():
    seed_demo()
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", vllm_version="0.33.0")
    gpus = [Gpu.objects.create(node=node, index=i, model="H100") for i in range(4)]
    found = {}
    for n, tier in enumerate(ModelTier.objects.order_by("name")):
        tier.engine_kind = "vllm"  # the demo runs them on the simulator; GPU hosts run vLLM
        tier.save()
        instance = EngineInstance.objects.create(tier=tier, node=node)
        instance.gpus.add(gpus[n])
        found[tier.name] = instance
    return found


@pytest.mark.parametrize("tier", ["text", "vlm-lite", "vlm-flagship"])
def test_each_demo_tier_launches_with_documented_flags_only(gpu_instances, tier):
    instance = gpu_instances[tier]
    argv, env = build_command(launch_spec(instance, 8100))
    assert check(argv, env) == []
    assert argv[2] == instance.tier.model_id and argv[argv.index("--served-model-name") + 1] == tier
    assert env["CUDA_VISIBLE_DEVICES"] == str(instance.gpus.get().index)
    assert env["VLLM_API_KEY"] == instance.api_key and instance.api_key not in argv


def test_vision_tiers_carry_their_policy_into_the_engine(gpu_instances):
    instance = gpu_instances["vlm-flagship"]
    policy = instance.tier.resolution_policy
    argv, env = build_command(launch_spec(instance, 8100))
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == f'{{"image": {policy.max_images_per_request}}}'
    assert argv[argv.index("--mm-processor-kwargs") + 1] == (
        f'{{"min_pixels": {policy.min_pixels}, "max_pixels": {policy.max_pixels}}}')
    assert env["VLLM_MAX_IMAGE_PIXELS"] == str(policy.max_input_pixels)
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    # The gateway fetches URLs itself: the engine fetches from nowhere.
    assert argv[argv.index("--allowed-media-domains") + 1] == "no-engine-fetching.invalid"


def test_the_text_tier_gets_no_multimodal_flags(gpu_instances):
    argv, _ = build_command(launch_spec(gpu_instances["text"], 8100))
    assert not {"--limit-mm-per-prompt", "--mm-processor-kwargs", "--allowed-media-domains"} & set(argv)


def test_the_checker_catches_a_wrong_command():
    problems = check(["vllm", "serve", "m", "--limit-mm-per-prompt", "image=4", "--disable-mm-preprocessor-cache",
                      "--allowed-media-domains", "*.example.com", "--kv-cache-dtype", "fp4"],
                     {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "false"})
    assert len(problems) == 5
