"""The `vllm serve` command lines of the demo tiers, checked flag by flag against vLLM's
documented flags (tests/workers/vllm_flags.py)."""

from __future__ import annotations

import json

import pytest

from controlplane.catalog.engine_settings import applicable
from controlplane.catalog.models import ModelTier
from controlplane.demo import seed_demo
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
        tier.engine_settings = applicable(tier.engine_settings, "vllm")
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
    assert argv[4] == instance.tier.model_id and argv[argv.index("--served-model-name") + 1] == tier
    assert env["CUDA_VISIBLE_DEVICES"] == str(instance.gpus.get().index)
    assert env["VLLM_API_KEY"] == instance.api_key and instance.api_key not in argv


def test_vision_tiers_carry_their_policy_into_the_engine(gpu_instances):
    instance = gpu_instances["vlm-flagship"]
    policy = instance.tier.resolution_policy
    argv, env = build_command(launch_spec(instance, 8100))
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == (
        f'{{"image": {policy.max_images_per_request}, "video": 0}}')
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
    problems = check(["python", "-m", "vllm.entrypoints.cli.main", "serve", "m", "--limit-mm-per-prompt", "image=4", "--disable-mm-preprocessor-cache",
                      "--allowed-media-domains", "*.example.com", "--kv-cache-dtype", "fp4"],
                     {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "false"})
    assert len(problems) == 5


def test_it_runs_vllm_with_the_engine_environments_python(gpu_instances, settings):
    settings.VLLM_PYTHON = "/opt/engines/vllm/bin/python"
    argv, _ = build_command(launch_spec(gpu_instances["vlm-lite"], 8100))
    assert argv[:5] == ["/opt/engines/vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve",
                        "Qwen/Qwen2.5-VL-3B-Instruct"]


def test_it_gives_transformers_5_the_size_form_of_the_pixel_bounds(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    policy = instance.tier.resolution_policy
    kwargs = {}
    for version in ("4.57.6", "5.19.0"):
        instance.node.transformers_version = version
        argv, _ = build_command(launch_spec(instance, 8100))
        kwargs[version] = json.loads(argv[argv.index("--mm-processor-kwargs") + 1])
    assert kwargs["4.57.6"] == {"min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels}
    assert kwargs["5.19.0"] == {"size": {"shortest_edge": policy.min_pixels, "longest_edge": policy.max_pixels}}


def test_a_tier_with_a_tool_call_parser_gets_vllms_tool_flags(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    instance.tier.engine_settings = {**instance.tier.engine_settings, "tool_call_parser": "hermes"}
    argv, env = build_command(launch_spec(instance, 8100))
    assert check(argv, env) == []
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    instance.tier.engine_settings = {}
    assert "--tool-call-parser" not in build_command(launch_spec(instance, 8100))[0]


def test_a_cpu_tier_sizes_its_kv_cache_in_host_memory_instead_of_gpu_memory(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    instance.gpus.clear()
    instance.tier.engine_settings = {"device": "cpu", "cpu_kvcache_space_gb": 2, "cpu_threads_bind": "0-1"}
    argv, env = build_command(launch_spec(instance, 8100))
    assert check(argv, env) == []
    assert "--gpu-memory-utilization" not in argv
    assert (env["VLLM_TARGET_DEVICE"], env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == (
        "cpu", "2", "0-1")
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_cpu_tier_gets_a_kv_cache_of_its_own_size_when_it_names_none(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    instance.tier.engine_settings = {"device": "cpu"}
    _, env = build_command(launch_spec(instance, 8100))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # vLLM's own default is a share of all memory


def test_a_cpu_tier_with_a_fractional_kv_cache_is_refused_before_launch(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    instance.tier.engine_settings = {"device": "cpu", "cpu_kvcache_space_gb": 1.5}
    with pytest.raises(ValueError, match="cpu_kvcache_space_gb: must be a whole number"):
        build_command(launch_spec(instance, 8100))


def test_a_cpu_engine_runs_below_the_node_agent_and_a_gpu_engine_does_not(gpu_instances):
    instance = gpu_instances["vlm-lite"]
    assert launch_spec(instance, 8100).nice == 0
    instance.tier.engine_settings = {"device": "cpu"}
    assert launch_spec(instance, 8100).nice == 10
