"""A tier's engine settings are typed and checked where they are saved: the typos an operator
made in the raw JSON box (`max_output_tokns`, `gpu_memory_utilisation`) and out-of-range
values are refused with a message naming the key, and what the gateway, launcher and
supervision read is one typed object."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ValidationError

from controlplane.catalog.engine_settings import EngineSettings, EngineSettingsError
from controlplane.catalog.models import ModelTier
from controlplane.gateway import state
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_output_tokns": 512}, "max_output_tokns: unknown setting (did you mean max_output_tokens?)"),
    ({"gpu_memory_utilisation": 0.9}, "gpu_memory_utilisation: unknown setting (did you mean gpu_memory_utilization?)"),
    ({"max_model_len": -5}, "max_model_len: must be at least 256"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization: must be at most 0.99"),
    ({"tensor_parallel_size": 1.5}, "tensor_parallel_size: must be a whole number"),
    ({"max_num_seqs": "32"}, "max_num_seqs: must be a number"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching: must be true or false"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype: must be one of auto, fp8, fp8_e4m3, fp8_e5m2"),
    ({"max_model_len": 4096, "max_output_tokens": 4096}, "max_output_tokens: must be below the context length"),
    ({"cpu_kvcache_space_gb": 2}, "cpu_kvcache_space_gb: applies to vLLM's CPU build only"),
    ({"decode_ms_per_token": 2}, "decode_ms_per_token: does not apply to vllm engines"),
])
def test_a_tier_with_unusable_engine_settings_is_refused_with_the_key_named(settings, message):
    tier = VisionTierFactory.build(engine_kind=ModelTier.EngineKind.VLLM, engine_settings=settings)
    with pytest.raises(ValidationError) as refused:
        tier.full_clean(exclude=["price_plan", "resolution_policy"])
    assert any(message in text for text in refused.value.message_dict["engine_settings"])
    with pytest.raises(ValidationError):  # saving past the form does not get round it either
        tier.save()


def test_settings_are_stored_as_typed_and_read_as_one_object():
    tier = VisionTierFactory(engine_kind=ModelTier.EngineKind.VLLM, engine_settings={
        "max_model_len": 8192.0, "max_output_tokens": 1024, "allowed_media_domains": [" Images.Example.com "],
        "scheduling_policy": "priority"})
    tier.refresh_from_db()
    assert tier.engine_settings == {"max_model_len": 8192, "max_output_tokens": 1024,
                                    "allowed_media_domains": ["images.example.com"], "scheduling_policy": "priority"}
    assert tier.settings.max_model_len == 8192 and tier.settings.tensor_parallel_size == 1
    spec = async_to_sync(state.tiers)()[tier.name]
    assert (spec.max_model_len, spec.max_output_tokens, spec.priority_scheduling) == (8192, 1024, True)
    assert spec.fetch_policy.allowed_domains == ("images.example.com",)


def test_the_gateway_does_not_serve_a_tier_whose_stored_settings_cannot_be_used(caplog):
    good = VisionTierFactory(name="good")
    bad = VisionTierFactory(name="bad")
    ModelTier.objects.filter(pk=bad.pk).update(engine_settings={"max_output_tokns": 5})  # past every check
    state.clear_caches()
    served = async_to_sync(state.tiers)()
    assert good.name in served and bad.name not in served
    assert "tier bad is not served: its engine settings cannot be used" in caplog.text


def test_every_error_is_reported_at_once():
    with pytest.raises(EngineSettingsError) as refused:
        EngineSettings.parse({"max_num_seqs": 0, "dtype": "fp4", "nonsense": 1}, "simulator")
    assert set(refused.value.messages) == {"max_num_seqs", "dtype", "nonsense"}
