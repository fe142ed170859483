"""InternVL 2 / 2.5 / 3: dynamic tiling into 448 px tiles plus a thumbnail.

Reference: transformers `models/got_ocr2/image_processing_got_ocr2.py`
(`get_all_supported_aspect_ratios`, `get_optimal_tiled_canvas`, `get_number_of_image_patches`)
and `models/internvl/processing_internvl.py`, which writes each image as
`<img>` + `<IMG_CONTEXT>` * (image_seq_length * tiles) + `</img>`. vLLM's remote-code path
(`model_executor/models/internvl.py`, `calculate_internvl_targets`) tiles the same way.

Defaults: OpenGVLab/InternVL3-*-hf (and InternVL2_5-8B's remote code): 448 px tiles,
min_patches 1, max_patches 12, a thumbnail when the image is cut into more than one tile,
image_seq_length 256 (448/14 = 32 patches a side, pixel-shuffled by 0.5 -> 16x16).
`crop_to_patches` is False in the image processor's own config but the InternVL processor
turns it on by default (`InternVLProcessorKwargs._defaults`), so True here.
"""

from __future__ import annotations

from functools import lru_cache

from controlplane.imaging.tokens._common import check_sides, square

MARKERS = 2  # <img> and </img>


@lru_cache(maxsize=64)
def _grids(min_patches: int, max_patches: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows) arrangements with min..max tiles, fewest tiles first."""
    grids = [
        (cols, rows)
        for cols in range(1, max_patches + 1)
        for rows in range(1, max_patches + 1)
        if min_patches <= cols * rows <= max_patches
    ]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def internvl_grid(
    width: int, height: int, *, tile: int, min_patches: int, max_patches: int
) -> tuple[int, int]:
    """The (columns, rows) grid whose aspect ratio is closest to the image's.

    On a tie the grid with more tiles wins while the image covers more than half of it.
    """
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in _grids(min_patches, max_patches):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def internvl(
    width: int,
    height: int,
    *,
    crop_to_patches: bool = True,
    min_patches: int = 1,
    max_patches: int = 12,
    size: int | dict = 448,
    image_seq_length: int = 256,
) -> int:
    check_sides(width, height)
    tiles = 1
    if crop_to_patches and max_patches > 1:
        cols, rows = internvl_grid(
            width, height, tile=square(size, 448), min_patches=min_patches, max_patches=max_patches
        )
        if cols * rows > 1:
            tiles = cols * rows + 1  # the tiles plus a thumbnail of the whole image
    return image_seq_length * tiles + MARKERS
