"""Long images are cut into tiles in reading order instead of being squashed."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw

from controlplane.imaging.errors import PolicyViolation
from controlplane.imaging.policy import Policy, normalise, normalise_tiles, plan_tiles

BANDS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 200, 20), (160, 40, 200)]


def striped(width: int, height: int, tall: bool = True) -> bytes:
    """Five colour bands along the long side, in reading order."""
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    long_side = height if tall else width
    for i, colour in enumerate(BANDS):
        start, end = i * long_side // 5, (i + 1) * long_side // 5
        draw.rectangle([0, start, width, end] if tall else [start, 0, end, height], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def centre(tile) -> tuple[int, int, int]:
    image = Image.open(io.BytesIO(tile.data)).convert("RGB")
    return image.getpixel((image.width // 2, image.height // 2))


def close(a, b, tolerance=40):
    return all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def test_a_tall_receipt_becomes_tiles_top_to_bottom():
    policy = Policy(max_aspect_ratio=4, max_pixels=200_000, max_images_per_request=8)
    tiles = normalise_tiles(striped(400, 8000), policy)  # aspect 20 -> 5 tiles of aspect 4
    assert len(tiles) == 5
    assert [t.tile for t in tiles] == list(range(5)) and {t.tiles for t in tiles} == {5}
    for tile, colour in zip(tiles, BANDS, strict=True):
        assert close(centre(tile), colour)
        assert max(tile.width, tile.height) / min(tile.width, tile.height) <= 4
        assert tile.width * tile.height <= 200_000


def test_a_wide_banner_becomes_tiles_left_to_right():
    tiles = normalise_tiles(striped(6000, 300, tall=False), Policy(max_aspect_ratio=4, max_images_per_request=8))
    assert len(tiles) == 5
    assert all(close(centre(t), c) for t, c in zip(tiles, BANDS, strict=True))
    assert all(t.height < t.width for t in tiles)


def test_each_tile_keeps_the_full_pixel_budget_so_text_stays_legible():
    policy = Policy(max_aspect_ratio=4, max_pixels=100_000, max_images_per_request=8)
    squashed_width = normalise(striped(400, 1600), policy).width  # aspect 4: one image
    tile_width = normalise_tiles(striped(400, 8000), policy)[0].width
    assert tile_width >= squashed_width  # the long image is not shrunk to fit one budget


def test_long_images_are_refused_when_the_policy_does_not_tile():
    with pytest.raises(PolicyViolation, match="aspect ratio 20.0"):
        normalise_tiles(striped(400, 8000), Policy(max_aspect_ratio=4, tile_long_images=False))
    with pytest.raises(PolicyViolation, match="aspect ratio"):
        normalise(striped(400, 8000), Policy(max_aspect_ratio=4))


def test_an_image_that_needs_too_many_tiles_is_refused():
    with pytest.raises(PolicyViolation, match="would need 5 tiles; at most 2"):
        normalise_tiles(striped(400, 8000), Policy(max_aspect_ratio=4, max_images_per_request=2))


@pytest.mark.parametrize("width, height", [(400, 8000), (8000, 400), (333, 9999), (1000, 1000), (50, 4000)])
def test_tile_plans_cover_the_image_without_gaps_or_overlap(width, height):
    policy = Policy(max_aspect_ratio=3, max_images_per_request=64, max_pixels=300_000)
    plan = plan_tiles(width, height, policy, policy.max_pixels)
    tall = height >= width
    along = [(b[1], b[3]) if tall else (b[0], b[2]) for b in plan.boxes]
    assert along[0][0] == 0 and along[-1][1] == (plan.height if tall else plan.width)
    assert all(a[1] == b[0] for a, b in zip(along, along[1:], strict=False))
    for box in plan.boxes:
        w, h = box[2] - box[0], box[3] - box[1]
        assert max(w, h) / min(w, h) <= 3 + 0.05 and w * h <= policy.max_pixels
