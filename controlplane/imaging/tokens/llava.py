"""LLaVA-1.5 (fixed square) and LLaVA-NeXT / LLaVA-1.6 (anyres grid + newlines).

Reference: transformers `models/llava/processing_llava.py`,
`models/llava_next/processing_llava_next.py` (`_get_number_of_features`,
`_get_unpadded_features`) and `image_processing_utils.select_best_resolution`.

Defaults are the llava-hf checkpoints' configs (llava-hf/llava-1.5-7b-hf,
llava-hf/llava-v1.6-mistral-7b-hf): CLIP ViT-L/14 at 336 px, processor_config.json
`patch_size` 14, `vision_feature_select_strategy` "default" (the CLS feature is dropped)
and `num_additional_image_tokens` 1 (the CLS the vision tower adds), so the base image is
(336/14)^2 = 576 features. LLaVA inserts no start/end markers: the `<image>` placeholder
itself is expanded, so every position counted here is a feature.
"""

from __future__ import annotations

from controlplane.imaging.tokens._common import check_sides

# llava-hf/llava-v1.6-mistral-7b-hf preprocessor_config.json, as [height, width].
LLAVA_NEXT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def _base_features(image_size, patch_size, strategy, num_additional_image_tokens) -> int:
    side = image_size // patch_size
    count = side * side + num_additional_image_tokens
    return count - 1 if strategy == "default" else count


def llava(
    width: int,
    height: int,
    *,
    image_size: int = 336,
    patch_size: int = 14,
    vision_feature_select_strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    # CLIPImageProcessor resizes the short side to 336 and centre-crops 336x336: the size of
    # the input does not matter.
    check_sides(width, height)
    return _base_features(
        image_size, patch_size, vision_feature_select_strategy, num_additional_image_tokens
    )


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The grid resolution (height, width) that keeps the most of the image and wastes least."""
    best = None
    best_effective, best_wasted = 0, float("inf")
    for cand_h, cand_w in pinpoints:
        scale = min(cand_w / width, cand_h / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = cand_w * cand_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (cand_h, cand_w), effective, wasted
    return best


def llava_next(
    width: int,
    height: int,
    *,
    image_grid_pinpoints=LLAVA_NEXT_GRID_PINPOINTS,
    image_size: int = 336,
    patch_size: int = 14,
    vision_feature_select_strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    check_sides(width, height)
    best_h, best_w = select_best_resolution(height, width, image_grid_pinpoints)
    patches = image_size // patch_size
    # The grid of crops, in patches, before the padding the image does not fill is removed.
    current_h = patches * (best_h // image_size)
    current_w = patches * (best_w // image_size)
    if width / height > current_w / current_h:
        new_h = int(round(height * (current_w / width), 7))
        current_h -= 2 * ((current_h - new_h) // 2)
    else:
        new_w = int(round(width * (current_h / height), 7))
        current_w -= 2 * ((current_w - new_w) // 2)
    unpadded = current_h * current_w
    newlines = current_h  # one image_newline feature closes every row of the unpadded grid
    base = _base_features(
        image_size, patch_size, vision_feature_select_strategy, num_additional_image_tokens
    )
    return unpadded + newlines + base
