"""Prompt positions an image occupies, per model family (Hugging Face `model_type`).

Each counter reproduces what the model's own processor does, because that is what the
engine will put in the prompt and what `prompt_tokens` will grow by: the vision features
plus the structural tokens the processor wraps around them (start/end markers, row breaks,
newlines). Pure Python on purpose: the gateway and the engine simulator call it per image.

Options are named like the HF processor's kwargs (what `--mm-processor-kwargs` would carry)
and default to the canonical checkpoint's shipped config; each family module says which.
Options that belong to another family's processor (e.g. `min_pixels` given to `llava_next`,
as the engine launcher passes them to every vision tier) are ignored, as the HF processor
ignores kwargs it does not take; names no supported processor takes raise TypeError, and
None means "the default".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from controlplane.imaging.tokens import qwen
from controlplane.imaging.tokens.gemma3 import gemma3, gemma3_num_crops
from controlplane.imaging.tokens.idefics3 import idefics3, idefics3_grid
from controlplane.imaging.tokens.internvl import internvl, internvl_grid
from controlplane.imaging.tokens.llava import llava, llava_next, select_best_resolution
from controlplane.imaging.tokens.phi3_v import phi3_v, phi3_v_hd_size
from controlplane.imaging.tokens.pixtral import pixtral, pixtral_grid
from controlplane.imaging.tokens.qwen import qwen2_vl, qwen3_vl, qwen_smart_resize

__all__ = [
    "FAMILIES",
    "TEXT_FAMILIES",
    "VISION_FAMILIES",
    "UnknownFamily",
    "count_image_tokens",
    "family_options",
    "gemma3_num_crops",
    "idefics3_grid",
    "internvl_grid",
    "phi3_v_hd_size",
    "pixtral_grid",
    "engine_image_tokens",
    "image_grid",
    "image_markers",
    "processor_options",
    "qwen_smart_resize",
    "select_best_resolution",
]


class UnknownFamily(ValueError):
    pass


_COUNTERS: dict[str, Callable[..., int]] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_vl,  # same processor and checkpoint defaults as Qwen2-VL
    "qwen3_vl": qwen3_vl,
    "llava": llava,
    "llava_next": llava_next,
    "internvl": internvl,
    "gemma3": gemma3,
    "pixtral": pixtral,
    "idefics3": idefics3,
    "phi3_v": phi3_v,
}

_OPTIONS: dict[str, frozenset[str]] = {
    family: frozenset(
        name
        for name, param in inspect.signature(counter).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    )
    for family, counter in _COUNTERS.items()
}
_ALL_OPTIONS = frozenset().union(*_OPTIONS.values())

# Families whose processor takes a pixel bound that a resolution policy sets.
_PIXEL_BOUNDED = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})

VISION_FAMILIES = tuple(sorted(_COUNTERS))
TEXT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = tuple(sorted(VISION_FAMILIES + TEXT_FAMILIES))


def _counter(family: str) -> Callable[..., int]:
    try:
        return _COUNTERS[family]
    except KeyError:
        raise UnknownFamily(f"no image token formula for model family {family!r}") from None


def family_options(family: str) -> dict:
    """The options a family's counter takes, with their defaults."""
    params = inspect.signature(_counter(family)).parameters
    return {name: params[name].default for name in sorted(_OPTIONS[family])}


def count_image_tokens(family: str, width: int, height: int, **options) -> int:
    """Prompt positions one `width` x `height` image occupies in a `family` model's prompt."""
    counter = _counter(family)
    unknown = set(options) - _ALL_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown image processor option(s) {', '.join(sorted(unknown))}; "
            f"{family} takes {', '.join(sorted(_OPTIONS[family]))}"
        )
    accepted = _OPTIONS[family]
    return counter(
        width,
        height,
        **{k: v for k, v in options.items() if k in accepted and v is not None},
    )


# Prompt positions of an image that lie outside what vLLM reports as its image tokens
# (`prompt_tokens_details.multimodal_tokens.image`, the length of the image's placeholder):
# Qwen-VL's chat template writes <|vision_start|> and <|vision_end|> around the placeholder,
# which the processor expands to the features alone. Checked against vLLM 0.32 for the
# Qwen-VL families; for the others the engine's count is kept but not compared.
_OUTSIDE_ENGINE_COUNT = {"qwen2_vl": qwen.MARKERS, "qwen2_5_vl": qwen.MARKERS, "qwen3_vl": qwen.MARKERS}


_GRID = {"qwen2_vl": 28, "qwen2_5_vl": 28, "qwen3_vl": 32}  # patch size x merge size


def image_grid(family: str) -> int:
    """The side multiple a family's processor resizes images to; 0 when it has none."""
    return _GRID.get(family, 0)


def image_markers(family: str) -> int | None:
    """Tokens the chat template writes around each image's placeholder, None when unknown."""
    return _OUTSIDE_ENGINE_COUNT.get(family)


def engine_image_tokens(family: str, tokens: int) -> int | None:
    """What vLLM reports for an image of `tokens` prompt positions, or None when unknown."""
    outside = image_markers(family)
    return None if outside is None else tokens - outside


def processor_options(family: str, *, min_pixels: int, max_pixels: int) -> dict:
    """The processor options a resolution policy sets for a family (what the engine gets).

    Only the Qwen-VL processors take pixel bounds (`min_pixels`/`max_pixels`, which the
    Qwen3-VL processor maps onto its `size`). The other families' processors have no
    pixel bound to set: LLaVA and Gemma 3 always resize to a fixed square, LLaVA-NeXT to a
    fixed set of grids, and the tile/edge limits of InternVL (`max_patches`), Idefics3 and
    Pixtral (`size`) and Phi-3-vision (`num_crops`) are model settings, not a resolution
    policy; the policy bounds those models only through the gateway's own downscale.
    """
    if family in _PIXEL_BOUNDED:
        return {"min_pixels": min_pixels, "max_pixels": max_pixels}
    return {}
