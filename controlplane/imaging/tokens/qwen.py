"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: native resolution, rounded to the merge grid.

Reference: transformers `models/qwen2_vl/image_processing_qwen2_vl.py` (`smart_resize`,
`get_number_of_image_patches`) and `processing_qwen2_vl.py` / `processing_qwen3_vl.py`, which
expand the chat template's `<|vision_start|><|image_pad|><|vision_end|>` so that the pad
becomes one token per merged patch. The two markers are part of what the image costs.

Give min_pixels and max_pixels together (as `processor_options` does): the fast (torch)
image processor applies them only as a pair, so a lone one can be ignored there (e.g. for
Qwen3-VL, whose config sets only `size`), while this counter honours either on its own.
"""

from __future__ import annotations

import math

from controlplane.imaging.tokens._common import check_sides

MARKERS = 2  # <|vision_start|> and <|vision_end|>


def qwen_smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's resize rule: both sides to multiples of `factor`, area within bounds."""
    check_sides(width, height)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds 200, "
            "which the Qwen-VL processor refuses"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _features(width, height, min_pixels, max_pixels, patch_size, merge_size) -> int:
    h, w = qwen_smart_resize(
        height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return (h // patch_size) * (w // patch_size) // (merge_size * merge_size)


def qwen2_vl(
    width: int,
    height: int,
    *,
    # Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct preprocessor_config.json:
    # min_pixels 3136 (4 features), max_pixels 12845056 (16384 features), patch 14, merge 2.
    # (The HF class default max_pixels, 28*28*1280, is NOT what the checkpoints ship.)
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 16384,
    patch_size: int = 14,
    merge_size: int = 2,
) -> int:
    return _features(width, height, min_pixels, max_pixels, patch_size, merge_size) + MARKERS


def qwen3_vl(
    width: int,
    height: int,
    *,
    # Qwen/Qwen3-VL-*-Instruct preprocessor_config.json: size.shortest_edge 65536 (64
    # features), size.longest_edge 16777216 (16384 features), patch 16, merge 2 (factor 32).
    min_pixels: int = 65536,
    max_pixels: int = 16777216,
    patch_size: int = 16,
    merge_size: int = 2,
) -> int:
    return _features(width, height, min_pixels, max_pixels, patch_size, merge_size) + MARKERS
