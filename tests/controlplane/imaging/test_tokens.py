"""Image token counts per model family. Expected values are worked out by hand from the
Qwen-VL processor's rules (factor = patch * merge, sides rounded to the factor, area kept
within [min_pixels, max_pixels]) rather than by calling the code under test again."""

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.imaging.tokens import (
    VISION_FAMILIES,
    UnknownFamily,
    count_image_tokens,
    family_options,
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


# ---------------------------------------------------------------- the other families
# Hand-computed from each processor's rules; test_tokens_parity.py checks them against
# transformers itself.


def test_every_supported_vision_family_is_listed():
    assert set(VISION_FAMILIES) == {
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "internvl", "gemma3",
        "pixtral", "idefics3", "phi3_v",
    }


def test_llava_next_two_to_one_image_fills_a_one_by_two_grid():
    # 672x336 picks the 336x672 (h x w) grid exactly: 24 x 48 patches, no padding to remove,
    # 1152 features + 24 row newlines + the 576-feature base image.
    assert count_image_tokens("llava_next", 672, 336) == 1152 + 24 + 576


def test_internvl_tiles_by_aspect_ratio_plus_thumbnail():
    # 448x448: 1x1 (the 2x2 tie loses: the image covers less than half of 2x2 tiles).
    assert count_image_tokens("internvl", 448, 448) == 256 + 2
    # 896x448: 2x1 tiles plus a thumbnail, 256 tokens each, plus <img></img>.
    assert count_image_tokens("internvl", 896, 448) == 3 * 256 + 2
    # max_patches 1 switches tiling off.
    assert count_image_tokens("internvl", 896, 448, max_patches=1) == 256 + 2


def test_gemma3_is_fixed_unless_pan_and_scan_cuts_crops():
    # "\n\n" <start_of_image> 256 x <image_soft_token> <end_of_image> "\n\n".
    assert count_image_tokens("gemma3", 1920, 1080) == 260
    assert count_image_tokens("gemma3", 10, 5000) == 260
    # 1500x500 with pan-and-scan: 3 crops of 500x500 -> 4 images of 260, plus the
    # (estimated) prose the processor writes around the crops.
    assert count_image_tokens("gemma3", 1500, 500, do_pan_and_scan=True) == 4 * 260 + 17 + 2


def test_pixtral_counts_a_break_per_row():
    # 1024x1024: 64 x 64 patches of 16 px, each of the 64 rows closed by [IMG_BREAK]/[IMG_END].
    assert count_image_tokens("pixtral", 1024, 1024) == 64 * 64 + 64
    # 2048x1024 is halved to 1024x512: 32 rows of 64.
    assert count_image_tokens("pixtral", 2048, 1024) == 32 * 64 + 32
    assert count_image_tokens("pixtral", 2048, 1024, longest_edge=2048) == 64 * 128 + 64


def test_idefics3_full_hd_is_three_rows_of_four_tiles_plus_global():
    # Longest edge to 1456: 1456x820 (819 rounded up to even); tiles of 364: 4 x 3.
    # Global: <fake><global-img> 169 x <image> <fake> = 172; each row: 4 x (2 + 169) + "\n".
    assert count_image_tokens("idefics3", 1920, 1080) == 172 + 3 * (4 * 171 + 1)
    assert count_image_tokens("idefics3", 1920, 1080, do_image_splitting=False) == 172


def test_phi3_v_square_image_with_four_crops():
    # Scale 2 -> 672x672 -> 2 x 2 crops: (4 + 1) * 144 + 1 + (2 + 1) * 12.
    assert count_image_tokens("phi3_v", 336, 336) == 757


def test_options_meant_for_another_family_are_ignored_like_the_processor_does():
    # The engine launcher passes min/max pixels to every vision tier; LLaVA-NeXT ignores them.
    assert count_image_tokens("llava_next", 672, 336, min_pixels=3136, max_pixels=1003520) == 1752


def test_an_option_no_processor_takes_is_refused():
    with pytest.raises(TypeError, match="max_pixel"):
        count_image_tokens("qwen2_5_vl", 448, 448, max_pixel=200704)


def test_none_means_the_default():
    assert count_image_tokens("qwen2_5_vl", 448, 448, min_pixels=None, max_pixels=None) == 258


def test_family_options_shows_the_checkpoint_defaults():
    assert family_options("qwen2_5_vl") == {
        "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136, "patch_size": 14}
    assert family_options("phi3_v") == {"num_crops": 4}


def test_processor_options_cover_every_qwen_vl_family_and_nothing_else():
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert processor_options(family, min_pixels=65536, max_pixels=1003520) == {
            "min_pixels": 65536, "max_pixels": 1003520}
    for family in ("qwen2", "qwen3", "internvl", "pixtral", "gemma3", "idefics3", "phi3_v"):
        assert processor_options(family, min_pixels=3136, max_pixels=1003520) == {}
