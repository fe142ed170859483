"""Gemma 3: a fixed 256-feature image, optionally plus pan-and-scan crops.

Reference: transformers `models/gemma3/processing_gemma3.py` and
`image_processing_gemma3.py` (`pan_and_scan`). Every image (and every crop) is written as
`"\\n\\n" <start_of_image> <image_soft_token>*256 <end_of_image> "\\n\\n"`; in the Gemma
tokenizer "\\n\\n" is one token, so a standalone image is 1 + 1 + 256 + 1 + 1 = 260 positions.
When the text right before or after the image already ends/starts with a newline, the
tokenizer merges the newlines ("\\n" + "\\n\\n" is the single token "\\n\\n\\n"), so in
that context the image adds one position less; 260 is the count of the image on its own.

Defaults: google/gemma-3-4b-it (image_seq_length 256, 896x896 SigLIP input; pan-and-scan
unset in preprocessor_config.json, so the processor's defaults apply: off, min crop 256,
at most 4 crops, activated from aspect ratio 1.2).
"""

from __future__ import annotations

import math

from controlplane.imaging.tokens._common import check_sides

STRUCTURE = 4  # "\n\n", <start_of_image>, <end_of_image>, "\n\n"

# With crops the processor replaces the image with "Here is the original image <boi> and here
# are some crops to help you see better <boi> <boi> ...". Those words are ordinary text whose
# count depends on the Gemma tokenizer, which is not available here. Estimate, NOT verified
# against the real tokenizer: one token per word (15) plus one for the space each phrase
# ends with (2), plus one per space between the crops' images.
PAN_AND_SCAN_TEXT_TOKENS = 17


def gemma3_num_crops(
    width: int,
    height: int,
    *,
    pan_and_scan_min_crop_size: int = 256,
    pan_and_scan_max_num_crops: int = 4,
    pan_and_scan_min_ratio_to_activate: float = 1.2,
) -> int:
    """How many pan-and-scan crops the image processor cuts (0 when it does not apply)."""
    check_sides(width, height)
    long, short = (width, height) if width >= height else (height, width)
    if long / short < pan_and_scan_min_ratio_to_activate:
        return 0
    crops = int(math.floor(long / short + 0.5))
    crops = min(int(math.floor(long / pan_and_scan_min_crop_size)), crops)
    crops = min(pan_and_scan_max_num_crops, max(2, crops))
    crop_long = int(math.ceil(long / crops))
    if min(crop_long, short) < pan_and_scan_min_crop_size:
        return 0
    return crops


def gemma3(
    width: int,
    height: int,
    *,
    image_seq_length: int = 256,
    do_pan_and_scan: bool = False,
    pan_and_scan_min_crop_size: int = 256,
    pan_and_scan_max_num_crops: int = 4,
    pan_and_scan_min_ratio_to_activate: float = 1.2,
) -> int:
    check_sides(width, height)
    crops = 0
    if do_pan_and_scan:
        crops = gemma3_num_crops(
            width,
            height,
            pan_and_scan_min_crop_size=pan_and_scan_min_crop_size,
            pan_and_scan_max_num_crops=pan_and_scan_max_num_crops,
            pan_and_scan_min_ratio_to_activate=pan_and_scan_min_ratio_to_activate,
        )
    tokens = (crops + 1) * (image_seq_length + STRUCTURE)
    if crops:
        tokens += PAN_AND_SCAN_TEXT_TOKENS + (crops - 1)
    return tokens
