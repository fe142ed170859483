"""Image token counts per model family. Expected values are worked out by hand from the
Qwen-VL processor's rules (factor = patch * merge, sides rounded to the factor, area kept
within [min_pixels, max_pixels]) rather than by calling the code under test again."""

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.imaging.tokens import (
    UnknownFamily,
    count_image_tokens,
    processor_options,
    qwen_smart_resize,
)


def test_full_hd_image_under_the_standard_cap_costs_1224_tokens():
    # 1920x1080 rounds to 1932x1092 (> 1003520), so it is scaled by
    # beta = sqrt(1920*1080/1003520) ~ 1.4375: 1080/beta/28 = 26.8 -> 728, 1920/beta/28 = 47.7 -> 1316.
    # 728/14 * 1316/14 = 52 * 94 = 4888 patches, merged 2x2 -> 1222 features, + 2 markers.
    assert count_image_tokens("qwen2_5_vl", 1920, 1080, max_pixels=1003520) == 1224


def test_qwen2_vl_counts_like_qwen2_5_vl():
    assert count_image_tokens("qwen2_vl", 1920, 1080, max_pixels=1003520) == 1224


def test_default_max_pixels_leaves_full_hd_at_native_resolution():
    # Default max is 28*28*16384 = 12845056, so 1920x1080 only rounds: 1932x1092,
    # 138 * 78 = 10764 patches -> 2691 features + 2.
    assert count_image_tokens("qwen2_5_vl", 1920, 1080) == 2693


def test_a_larger_cap_costs_more_tokens_for_the_same_image():
    low = count_image_tokens("qwen2_5_vl", 1920, 1080, max_pixels=200704)
    high = count_image_tokens("qwen2_5_vl", 1920, 1080, max_pixels=1003520)
    assert low < high
    # beta = sqrt(2073600/200704) ~ 3.214: 1080 -> 336 (12*28), 1920 -> 588 (21*28):
    # 24 * 42 / 4 = 252 features + 2.
    assert low == 254


def test_tiny_image_is_upscaled_to_min_pixels():
    # 10x10 rounds to 0x0 (< 3136): scaled up by sqrt(3136/100) = 5.6 to 56x56,
    # 4x4 patches -> 4 features + 2.
    assert count_image_tokens("qwen2_5_vl", 10, 10) == 6
    assert qwen_smart_resize(10, 10, factor=28, min_pixels=3136, max_pixels=1003520) == (56, 56)


def test_a_larger_min_pixels_upscales_further():
    # min 12544 = 112*112: 10x10 -> 112x112, 8x8 patches -> 16 features + 2.
    assert count_image_tokens("qwen2_5_vl", 10, 10, min_pixels=112 * 112) == 18


def test_an_exact_multiple_of_the_factor_is_kept():
    # 448x448 is 16x16 factors of 28: 32x32 patches -> 256 features + 2.
    assert count_image_tokens("qwen2_5_vl", 448, 448) == 258


@pytest.mark.parametrize("width, height", [(201, 1), (1, 201), (4020, 20), (20, 4020)])
def test_aspect_ratio_beyond_200_is_refused(width, height):
    with pytest.raises(ValueError, match="aspect ratio"):
        count_image_tokens("qwen2_5_vl", width, height)


def test_aspect_ratio_of_exactly_200_is_accepted():
    assert count_image_tokens("qwen2_5_vl", 4000, 20) > 2


@pytest.mark.parametrize("width, height", [(0, 10), (10, 0), (-5, 10)])
def test_non_positive_sides_are_refused(width, height):
    with pytest.raises(ValueError):
        count_image_tokens("qwen2_5_vl", width, height)


def test_qwen3_vl_uses_a_factor_of_32():
    # 1000 -> round(31.25) * 32 = 992 per side, 62x62 patches of 16 -> 961 features + 2.
    # With Qwen2.5's factor 28 the same image would be 1008x1008 -> 1296 + 2.
    assert count_image_tokens("qwen3_vl", 1000, 1000) == 963
    assert count_image_tokens("qwen2_5_vl", 1000, 1000) == 1298


def test_qwen3_vl_default_min_pixels_upscales_small_images():
    # Default min 65536 = 256*256: 100x100 -> 256x256, 16x16 patches -> 64 features + 2.
    assert count_image_tokens("qwen3_vl", 100, 100) == 66


@pytest.mark.parametrize("width, height", [(1, 1), (336, 336), (1920, 1080), (100, 4000)])
def test_llava_always_costs_576(width, height):
    assert count_image_tokens("llava", width, height) == 576


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt-4o", ""])
def test_family_without_a_formula_raises_unknown_family(family):
    with pytest.raises(UnknownFamily, match="no image token formula"):
        count_image_tokens(family, 100, 100)


def test_processor_options_only_for_qwen_families():
    assert processor_options("qwen2_5_vl", min_pixels=3136, max_pixels=1003520) == {
        "min_pixels": 3136, "max_pixels": 1003520}
    assert processor_options("llava", min_pixels=3136, max_pixels=1003520) == {}


sides = st.integers(min_value=1, max_value=20_000)


@settings(max_examples=400, deadline=None)
@given(
    width=sides,
    height=sides,
    min_pixels=st.integers(min_value=56 * 56, max_value=256 * 256),
    max_pixels=st.integers(min_value=448 * 448, max_value=28 * 28 * 16384),
)
def test_qwen2_5_vl_tokens_follow_the_resized_grid(width, height, min_pixels, max_pixels):
    assume(max(width, height) / min(width, height) <= 200)
    tokens = count_image_tokens(
        "qwen2_5_vl", width, height, min_pixels=min_pixels, max_pixels=max_pixels
    )
    h, w = qwen_smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
    # 14-pixel patches merged 2x2: one feature per 28x28 block, plus two marker tokens.
    assert tokens - 2 == h * w / 784
    assert min_pixels <= h * w <= max_pixels


@settings(max_examples=200, deadline=None)
@given(short=st.integers(min_value=1, max_value=100), stretch=st.floats(min_value=200.01, max_value=1000))
def test_every_aspect_ratio_beyond_200_is_refused(short, stretch):
    long = math.ceil(short * stretch)
    assume(long / short > 200)
    with pytest.raises(ValueError):
        count_image_tokens("qwen2_5_vl", long, short)
    with pytest.raises(ValueError):
        count_image_tokens("qwen2_5_vl", short, long)
