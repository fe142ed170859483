"""Idefics3 (and SmolVLM v1, which shares the model_type): tiles plus a global image.

Reference: transformers `models/idefics3/image_processing_idefics3.py` (`resize`,
`resize_for_vision_encoder`, `split_image`) and `processing_idefics3.py`
(`_prompt_split_image`, `_prompt_single_image`). Each tile is written as
`<fake_token_around_image><row_r_col_c>` + `<image>` * image_seq_len, each row of tiles ends
with "\\n", then "\\n<fake_token_around_image><global-img>" + `<image>` * image_seq_len +
`<fake_token_around_image>`. In the Llama 3 tokenizer the last row's "\\n" and the "\\n"
before the global image are the single token "\\n\\n", which is how the processor's own
count (`_get_num_multimodal_tokens`) treats them: (seq + 3) + rows * ((seq + 2) * cols + 1).

This follows the full preprocessing path, not `get_number_of_image_patches`: that shortcut
skips the int() truncation `resize_for_vision_encoder` applies and reports a 1x1 grid when
the image is not split, which the processor writes as a single image.

Defaults: HuggingFaceM4/Idefics3-8B-Llama3 (size.longest_edge 1456 = 4 * 364,
max_image_size.longest_edge 364, image_seq_len 169, do_image_splitting True).
HuggingFaceTB/SmolVLM-Instruct uses 1536 / 384 / 81.
"""

from __future__ import annotations

import math

from controlplane.imaging.tokens._common import check_sides, edge

MAX_IMAGE_SIZE = 4096  # the image processor's absolute cap on either side


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    # The longest side becomes max_len (small images are upscaled); the other keeps the
    # aspect ratio, truncated, then rounded up to an even number.
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def idefics3_grid(
    width: int, height: int, *, longest_edge: int, tile: int, do_image_splitting: bool = True
) -> tuple[int, int]:
    """(rows, columns) of tiles; (0, 0) when the image is sent whole."""
    check_sides(width, height)
    height, width = _rescale_to_max_len(height, width, longest_edge)
    height, width = _scale_below(height, width, MAX_IMAGE_SIZE)
    if not do_image_splitting:
        return 0, 0
    # resize_for_vision_encoder: sides up to multiples of the tile.
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return math.ceil(height / tile), math.ceil(width / tile)
    return 0, 0


def idefics3(
    width: int,
    height: int,
    *,
    size: int | dict = 1456,
    max_image_size: int | dict = 364,
    image_seq_len: int = 169,
    do_image_splitting: bool = True,
) -> int:
    rows, cols = idefics3_grid(
        width,
        height,
        longest_edge=edge(size, "longest_edge", 1456),
        tile=edge(max_image_size, "longest_edge", 364),
        do_image_splitting=do_image_splitting,
    )
    single = image_seq_len + 3  # <fake><global-img> <image>*seq <fake>
    if rows == 0:
        return single
    return single + rows * ((image_seq_len + 2) * cols + 1)
