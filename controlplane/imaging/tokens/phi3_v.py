"""Phi-3-vision / Phi-3.5-vision: the HD transform into 336 px crops.

Phi3-V is remote code (not in transformers). References: the checkpoint's
`image_processing_phi3_v.py` (`calc_hd_transform_size`, `calc_padded_size`,
`calc_num_image_tokens_from_image_size`) as vendored in vLLM
`model_executor/models/phi3v.py` (`_calc_hd_transform_size`, `get_phi3v_image_feature_size`).

The image is turned landscape, scaled so that `scale` columns of 336 px crops fit with
scale * ceil(scale / ratio) <= num_crops, its height padded up to a multiple of 336, and
turned back. With h x w crops the image is (h*w + 1) * 144 features (12x12 after a 2x2
merge, per crop plus one global view), 1 separator between the crops and the global view,
and (h + 1) * 12 row-newline features: ((h*w + 1) * 144) + 1 + (h + 1) * 12. The
`<|image_1|>` tag in the prompt is replaced by exactly that many positions.

Default: microsoft/Phi-3.5-vision-instruct preprocessor_config.json num_crops 4
(microsoft/Phi-3-vision-128k-instruct ships 16).
"""

from __future__ import annotations

import math

from controlplane.imaging.tokens._common import check_sides

CROP = 336


def phi3_v_hd_size(width: int, height: int, *, num_crops: int) -> tuple[int, int]:
    """(width, height) after the HD transform and padding, both multiples of 336."""
    check_sides(width, height)
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_width = int(scale * CROP)
    new_height = int(new_width / ratio)
    if new_height < 1:
        raise ValueError(f"a {width}x{height} image is too thin for the Phi-3-vision HD transform")
    padded_height = int(math.ceil(new_height / CROP) * CROP)
    if transposed:
        return padded_height, new_width
    return new_width, padded_height


def phi3_v(width: int, height: int, *, num_crops: int = 4) -> int:
    padded_w, padded_h = phi3_v_hd_size(width, height, num_crops=num_crops)
    rows, cols = padded_h // CROP, padded_w // CROP
    return (rows * cols + 1) * 144 + 1 + (rows + 1) * 12
