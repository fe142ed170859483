"""Pixtral: native resolution up to a longest edge, one token per patch, a break per row.

Reference: transformers `models/pixtral/image_processing_pixtral.py`
(`get_resize_output_image_size`, `_num_image_tokens`) and `processing_pixtral.py`: the image
becomes rows of `[IMG]` tokens, each row closed by `[IMG_BREAK]`, the last one by `[IMG_END]`,
so rows * cols + rows positions.

The transformers processor shrinks oversize images with floor(); mistral_common (vLLM's
`tokenizer_mode="mistral"` for mistralai/Pixtral-12B-2409) uses round(), so counts can differ
by a row or column for images larger than the longest edge. This follows transformers.

Defaults: mistral-community/pixtral-12b (size.longest_edge 1024, patch 16, no spatial merge).
Mistral-Small-3.1 style checkpoints use longest_edge 1540, patch 14, spatial_merge_size 2.
"""

from __future__ import annotations

import math

from controlplane.imaging.tokens._common import check_sides, edge


def pixtral_grid(
    width: int, height: int, *, longest_edge: int, patch: int
) -> tuple[int, int]:
    """(rows, columns) of image tokens."""
    check_sides(width, height)
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height = int(math.floor(height / ratio))
        width = int(math.floor(width / ratio))
    rows = (height - 1) // patch + 1
    cols = (width - 1) // patch + 1
    if rows < 1 or cols < 1:
        raise ValueError(
            f"a {width}x{height} image is too thin for Pixtral: it shrinks to zero pixels"
        )
    return rows, cols


def pixtral(
    width: int,
    height: int,
    *,
    size: int | dict | None = None,
    longest_edge: int | None = None,
    patch_size: int = 16,
    spatial_merge_size: int = 1,
) -> int:
    """`size` is the HF option ({"longest_edge": n}); `longest_edge` is a shorthand for it."""
    limit = longest_edge if longest_edge is not None else edge(size, "longest_edge", 1024)
    rows, cols = pixtral_grid(width, height, longest_edge=limit, patch=patch_size * spatial_merge_size)
    return rows * cols + rows
