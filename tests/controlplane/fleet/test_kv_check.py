"""The KV planner beside the cache an engine reports: read from vLLM's metrics, planned from
the model's config.json."""

from __future__ import annotations

import json

import pytest

from controlplane.fleet.engine_metrics import snapshot
from controlplane.fleet.kv_check import kv_check
from controlplane.fleet.models import EngineInstance, Gpu, Node
from controlplane.imaging import kv
from workers.engines.simulator.metrics import Metrics

pytestmark = pytest.mark.django_db

# Qwen2.5-VL-7B's config.json, the fields the planner reads (as its checkpoint has them).
QWEN_7B = {"model_type": "qwen2_5_vl", "torch_dtype": "bfloat16", "hidden_size": 3584, "num_attention_heads": 28,
           "num_hidden_layers": 28, "num_key_value_heads": 4}


def _model(tmp_path, config, weights_bytes=0):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights_bytes:
        with open(tmp_path / "model.safetensors", "wb") as f:
            f.truncate(weights_bytes)
    return str(tmp_path)


def _instance(world, model_id, settings, **fields):
    world.vision.model_id, world.vision.engine_kind = model_id, "vllm"
    world.vision.engine_settings = settings
    world.vision.save()
    node = Node.objects.create(name="gpu-1", queue="node.gpu-1")
    return EngineInstance.objects.create(tier=world.vision, node=node, **fields)


def test_the_engines_kv_size_is_read_from_its_cache_config():
    metrics = Metrics("m")
    metrics.kv_blocks, metrics.block_size = 16384, 128
    assert snapshot(metrics.render()).kv_capacity_tokens == 2_097_152
    assert snapshot('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n').kv_capacity_tokens == 0


def test_a_config_gives_the_same_kv_bytes_as_the_preset_of_its_checkpoint():
    arch = kv.arch_from_config({"text_config": QWEN_7B})
    assert kv.kv_bytes_per_token(arch) == kv.kv_bytes_per_token(kv.PRESETS["qwen2.5-vl-7b"]) == 57_344
    assert kv.kv_bytes_per_token(kv.arch_from_config(QWEN_7B, dtype="float32")) == 2 * 57_344
    with pytest.raises(kv.ConfigError):
        kv.arch_from_config({"hidden_size": 8})


def test_a_cpu_engine_is_planned_from_its_kv_space_and_shown_off_by_what_it_reports(world, tmp_path):
    instance = _instance(world, _model(tmp_path, {"text_config": QWEN_7B}),
                         {"device": "cpu", "cpu_kvcache_space_gb": 2}, kv_capacity_tokens=36_000)
    check = kv_check(instance)
    # 2 GiB / (128 tokens x 57,344 bytes) = 292 whole blocks.
    assert check.predicted == 292 * 128 == 37_376
    assert check.difference_text == "-3.7% off the plan" and "2 GiB of host memory" in check.basis


def test_a_gpu_engine_is_planned_from_its_gpus_memory_less_its_weights(world, tmp_path):
    model = _model(tmp_path, {"text_config": QWEN_7B}, weights_bytes=16 * kv.GIB)
    instance = _instance(world, model, {"gpu_memory_utilization": 0.9})
    instance.gpus.add(Gpu.objects.create(node=instance.node, index=0, model="L40S", memory_mib=48 * 1024))
    check = kv_check(instance)
    budget = 48 * kv.GIB * 0.9 - 16 * kv.GIB - 2 * kv.GIB
    assert check.predicted == int(budget // (16 * 57_344)) * 16 and check.reported is None
    assert check.difference is None and "16.0 GiB" in check.basis


def test_no_plan_is_made_without_the_models_files_or_for_another_engine(world, tmp_path):
    instance = _instance(world, str(tmp_path / "absent"), {"device": "cpu"})
    assert kv_check(instance).predicted is None and "not on this host" in kv_check(instance).basis
    world.vision.engine_kind, world.vision.engine_settings = "simulator", {}
    world.vision.save()
    assert kv_check(EngineInstance.objects.get(pk=instance.pk)).predicted is None


def test_the_instance_page_shows_the_plan_beside_the_engines_figure(client, world, tmp_path):
    instance = _instance(world, _model(tmp_path, {"text_config": QWEN_7B}), {"device": "cpu"},
                         kv_capacity_tokens=kv.cpu_kv_token_capacity(kv.arch_from_config(QWEN_7B)))
    client.force_login(world.operator)
    page = client.get(f"/fleet/{instance.pk}/").content.decode()
    assert "exactly as planned" in page and "VLLM_CPU_KVCACHE_SPACE" in page
