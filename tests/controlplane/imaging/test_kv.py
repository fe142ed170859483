"""KV estimates, checked against the formula in REFERENCE.md section 4."""

from __future__ import annotations

import math

import pytest

from controlplane.imaging.kv import (
    GIB,
    GPUS,
    PRESETS,
    Deployment,
    RequestClass,
    concurrency,
    image_kv_bytes,
    kv_bytes_per_token,
    largest_resolution,
    preset_for,
)

Q3, Q7, Q72 = PRESETS["qwen2.5-vl-3b"], PRESETS["qwen2.5-vl-7b"], PRESETS["qwen2.5-vl-72b"]


@pytest.mark.parametrize("arch, expected", [(Q3, 36_864), (Q7, 57_344), (Q72, 327_680)])
def test_bf16_bytes_per_token_match_the_reference(arch, expected):
    assert kv_bytes_per_token(arch) == expected == 2 * arch.layers * arch.kv_heads * arch.head_dim * 2


def test_a_1369_token_image_on_the_7b_holds_about_78_5_mb():
    # 1036 x 1036 is 37 x 37 merged patches: 1369 features, plus vision start and end.
    held = image_kv_bytes(Q7, 1036, 1036, max_pixels=12_845_056)
    assert held == (1369 + 2) * 57_344
    assert round(1369 * 57_344 / 1e6, 1) == 78.5


def test_fp8_halves_the_kv_cache():
    assert kv_bytes_per_token(Q7, kv_cache_dtype="fp8") * 2 == kv_bytes_per_token(Q7)


def test_tensor_parallel_splits_kv_heads_and_replicates_when_too_few():
    assert kv_bytes_per_token(Q72, tensor_parallel=4, per_gpu=True) == 327_680 // 4
    # The 3B has 2 KV heads: on 4 GPUs each still holds one, so per-GPU KV halves, not quarters.
    assert kv_bytes_per_token(Q3, tensor_parallel=4, per_gpu=True) == 36_864 // 2


def test_concurrency_for_a_mix_follows_from_the_budget():
    deployment = Deployment(Q7, GPUS["L4"], gpu_memory_utilization=0.9, overhead_gib=2.0)
    budget = 24 * GIB * 0.9 - 8.29e9 * 2 - 2 * GIB
    capacity = int(budget // (16 * 57_344)) * 16
    mix = [RequestClass(0.5, text_tokens=200, output_tokens=100),
           RequestClass(0.5, text_tokens=50, output_tokens=200, images=((1920, 1080),))]
    image = 1224  # 1920x1080 at the default 1,003,520-pixel cap
    per_request = 0.5 * (math.ceil(300 / 16) * 16) + 0.5 * (math.ceil((50 + image + 200) / 16) * 16)
    fit = concurrency(deployment, mix, max_pixels=1_003_520)
    assert fit.kv_token_capacity == capacity
    assert fit.kv_tokens_per_request == per_request
    assert fit.concurrent_requests == int(capacity // per_request)


def test_the_72b_does_not_fit_on_one_80gb_gpu_but_fits_on_four():
    one = Deployment(Q72, GPUS["H100 80GB"])
    four = Deployment(Q72, GPUS["H100 80GB"], tensor_parallel=4)
    assert one.kv_token_capacity == 0
    assert four.kv_token_capacity > 100_000


def test_the_largest_resolution_shrinks_as_the_target_concurrency_grows():
    deployment = Deployment(Q7, GPUS["A100 80GB"])
    found = [largest_resolution(deployment, target_concurrency=n) for n in (8, 32, 128)]
    assert all(r is not None for r in found)
    pixels = [r.width * r.height for r in found]
    assert pixels[0] > pixels[1] > pixels[2]
    for n, result in zip((8, 32, 128), found, strict=True):
        assert result.concurrent_requests >= n
        bigger = round(result.width * 1.05), round(result.height * 1.05)
        mix = [RequestClass(1.0, 100, 256, (bigger,))]
        assert concurrency(deployment, mix, max_pixels=16384 ** 2).concurrent_requests < n or result.width >= 16000


def test_an_impossible_target_has_no_resolution():
    assert largest_resolution(Deployment(Q7, GPUS["L4"]), target_concurrency=10**6) is None


def test_presets_are_found_by_checkpoint_name():
    assert preset_for("qwen/qwen2.5-vl-7b-instruct") is Q7
    assert preset_for("meta-llama/Llama-3.1-8B") is None
