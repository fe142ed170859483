"""Prompt positions an image occupies, per model family (Hugging Face `model_type`).

Each counter reproduces what the model's own processor does, because that is what the
engine will put in the prompt and what `prompt_tokens` will grow by: the vision features
plus the structural tokens the processor wraps around them.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class UnknownFamily(ValueError):
    pass


def qwen_smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's resize rule: both sides to multiples of `factor`, area within bounds."""
    if height <= 0 or width <= 0:
        raise ValueError("image sides must be positive")
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


def _qwen(patch_size: int, default_min: int, default_max: int) -> Callable[..., int]:
    def count(
        width: int,
        height: int,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        patch_size: int = patch_size,
        merge_size: int = 2,
    ) -> int:
        factor = patch_size * merge_size
        h, w = qwen_smart_resize(
            height,
            width,
            factor=factor,
            min_pixels=default_min if min_pixels is None else min_pixels,
            max_pixels=default_max if max_pixels is None else max_pixels,
        )
        features = (h // patch_size) * (w // patch_size) // (merge_size * merge_size)
        return features + 2  # <|vision_start|> ... <|vision_end|>

    return count


def _llava(width: int, height: int, *, image_size: int = 336, patch_size: int = 14) -> int:
    # LLaVA-1.5 resizes every image to image_size square: (336/14)^2 = 576 features.
    del width, height
    return (image_size // patch_size) ** 2


_COUNTERS: dict[str, Callable[..., int]] = {
    "qwen2_vl": _qwen(14, 56 * 56, 28 * 28 * 16384),
    "qwen2_5_vl": _qwen(14, 56 * 56, 28 * 28 * 16384),
    "qwen3_vl": _qwen(16, 65536, 16777216),
    "llava": _llava,
}

VISION_FAMILIES = tuple(sorted(_COUNTERS))
TEXT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = tuple(sorted(VISION_FAMILIES + TEXT_FAMILIES))


def count_image_tokens(family: str, width: int, height: int, **options) -> int:
    """Prompt positions one `width` x `height` image occupies in a `family` model's prompt."""
    try:
        counter = _COUNTERS[family]
    except KeyError:
        raise UnknownFamily(f"no image token formula for model family {family!r}") from None
    return counter(width, height, **options)


def processor_options(family: str, *, min_pixels: int, max_pixels: int) -> dict:
    """The processor options a resolution policy sets for a family (what the engine gets)."""
    if family.startswith("qwen"):
        return {"min_pixels": min_pixels, "max_pixels": max_pixels}
    return {}
