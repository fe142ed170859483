"""Commercial API image-token estimates, checked against the providers' own worked examples
(quoted in controlplane/imaging/commercial.py) and hand computation."""

import math
from decimal import Decimal

import pytest

from controlplane.imaging.commercial import (
    OFFERS,
    PRICES_AS_OF,
    anthropic_tokens,
    commercial_costs,
    gemini_tokens,
    openai_patch_tokens,
    openai_tile_tokens,
)

# --------------------------------------------------------------------------- OpenAI tiles


def test_openai_low_detail_is_a_flat_85():
    # OpenAI guide: "A 4096 x 8192 image in detail: low mode costs 85 tokens".
    assert openai_tile_tokens(4096, 8192, "low") == 85
    assert openai_tile_tokens(10, 10, "low") == 85


def test_openai_1024_square_costs_765():
    # OpenAI guide: 1024 < 2048, shortest side 1024 -> 768x768, 4 tiles: 85 + 4 * 170.
    assert openai_tile_tokens(1024, 1024) == 765


def test_openai_2048x4096_costs_1105():
    # OpenAI guide: fit in 2048 -> 1024x2048, shortest side -> 768x1536, 2 x 3 tiles.
    assert openai_tile_tokens(2048, 4096) == 1105
    assert openai_tile_tokens(4096, 2048) == 1105


def test_openai_small_images_are_not_upscaled():
    # 512x512 is one tile; one pixel more in either direction is a second tile.
    assert openai_tile_tokens(512, 512) == 85 + 170
    assert openai_tile_tokens(513, 500) == 85 + 2 * 170
    assert openai_tile_tokens(513, 513) == 85 + 4 * 170


def test_openai_full_hd_is_six_tiles():
    # 1920x1080 -> shortest side 768: 1365.3x768 -> 3 x 2 tiles.
    assert openai_tile_tokens(1920, 1080) == 85 + 6 * 170
    assert openai_tile_tokens(1920, 1080, "auto") == 1105


def test_openai_unknown_detail_is_refused():
    with pytest.raises(ValueError, match="detail"):
        openai_tile_tokens(100, 100, "medium")


# --------------------------------------------------------------------------- OpenAI patches


def test_openai_patches_under_the_cap_are_counted_directly():
    # OpenAI guide: 1024x1024 -> 32 x 32 = 1024 patches.
    assert openai_patch_tokens(1024, 1024) == 1024
    # Partial patches count: 33x33 px needs 2 x 2 patches.
    assert openai_patch_tokens(33, 33) == 4


def test_openai_1800x2400_is_shrunk_to_1452_patches():
    # OpenAI guide: 57 x 75 = 4275 patches > 1536; shrink by sqrt(32*32*1536/(1800*2400))
    # = 0.603 -> 1086 x 1448 (33.94 x 45.25 patches); fit the width to 33 whole patches
    # (x 33/33.94) -> 1056 x 1408 -> 33 x 44 = 1452.
    assert openai_patch_tokens(1800, 2400) == 1452


def test_openai_patch_multipliers_apply_to_the_patch_count():
    # gpt-4.1-mini: 1452 * 1.62 = 2352.24, rounded up.
    assert openai_patch_tokens(1800, 2400, multiplier=1.62) == 2353
    assert openai_patch_tokens(1024, 1024, multiplier=2.46) == math.ceil(1024 * 2.46)


def test_openai_patches_never_exceed_the_cap():
    for w, h in [(4000, 3000), (10000, 100), (100, 10000), (2048, 768), (6000, 6000)]:
        assert openai_patch_tokens(w, h) <= 1536
    assert openai_patch_tokens(2048, 768) == 1536  # exactly 64 x 24


# --------------------------------------------------------------------------- Anthropic


def test_anthropic_documented_examples():
    # Anthropic vision docs: 200x200 ~54, 1000x1000 ~1334, 1092x1092 ~1590 (w*h/750).
    assert anthropic_tokens(200, 200) == 54
    assert anthropic_tokens(1000, 1000) == 1334
    assert anthropic_tokens(1092, 1092) == 1590


def test_anthropic_long_edge_over_1568_is_scaled_down_first():
    # 3136x200 -> long edge 1568: 1568x100 -> 209.07 -> 210.
    assert anthropic_tokens(3136, 200) == 210
    # A 12 MP photo is capped near the documented maximum.
    assert 1580 <= anthropic_tokens(4000, 3000) <= 1640


# --------------------------------------------------------------------------- Gemini


def test_gemini_small_images_are_one_258_token_tile():
    assert gemini_tokens(384, 384) == 258
    assert gemini_tokens(1, 1) == 258


def test_gemini_crop_unit_is_the_short_side_over_1_5_clamped():
    # 1920x1080: unit 1080/1.5 = 720 -> 3 x 2 crops.
    assert gemini_tokens(1920, 1080) == 6 * 258
    # 1024x1024: unit 682 -> 2 x 2 crops.
    assert gemini_tokens(1024, 1024) == 4 * 258
    # 385x100: unit clamps up to 256 -> 2 x 1 crops.
    assert gemini_tokens(385, 100) == 2 * 258
    # 3000x3000: unit clamps down to 768 -> 4 x 4 crops.
    assert gemini_tokens(3000, 3000) == 16 * 258


def test_gemini_scales_images_beyond_3072_down_first():
    # 6000x4000 -> 3072x2048: unit 768 -> 4 x 3 crops.
    assert gemini_tokens(6000, 4000) == 12 * 258


# --------------------------------------------------------------------------- price table


def test_commercial_costs_lists_every_offer_with_tokens_and_usd():
    rows = commercial_costs(1920, 1080)
    assert [(r["provider"], r["model"]) for r in rows] == [(o.provider, o.model) for o in OFFERS]
    assert all(set(r) == {"provider", "model", "tokens", "usd"} for r in rows)
    by_model = {r["model"]: r for r in rows}
    assert by_model["gpt-4o"]["tokens"] == 1105
    assert by_model["gpt-4o"]["usd"] == Decimal("0.002762")  # 0.0027625 rounded half-even
    assert by_model["gemini-2.5-flash"]["tokens"] == 1548
    assert by_model["gemini-2.5-flash"]["usd"] == Decimal("0.000464")  # 0.0004644
    assert float(by_model["claude-sonnet-4-5"]["usd"]) == pytest.approx(by_model["claude-sonnet-4-5"]["tokens"] * 3e-6,
                                                                       abs=1e-6)
    # Money is Decimal, rounded to a millionth of a dollar: no float noise on the page.
    assert all(r["usd"].as_tuple().exponent == -6 for r in rows)


def test_price_table_is_dated_and_sourced():
    assert PRICES_AS_OF
    for offer in OFFERS:
        assert offer.source and offer.usd_per_million_input > 0


@pytest.mark.parametrize("width, height", [(0, 10), (10, 0), (-1, 5)])
def test_non_positive_sides_are_refused(width, height):
    with pytest.raises(ValueError):
        commercial_costs(width, height)


def test_low_detail_is_what_openai_tile_models_charge_for_it_and_changes_no_other_offer():
    high = {row["model"]: row["tokens"] for row in commercial_costs(1920, 1080)}
    low = {row["model"]: row["tokens"] for row in commercial_costs(1920, 1080, detail="low")}
    assert (high["gpt-4o"], low["gpt-4o"]) == (1105, 85)
    assert {m: t for m, t in low.items() if m != "gpt-4o"} == {m: t for m, t in high.items() if m != "gpt-4o"}
