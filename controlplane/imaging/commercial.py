"""What one image would cost on commercial vision APIs: token estimates and list prices.

For "what would this cost elsewhere" comparisons next to our own tiers. These are the
providers' published rules, not their code: treat every number as an estimate, and the
prices as a dated snapshot of the sources named below.

Pure on purpose (no Django, PIL or numpy), like `controlplane.imaging.tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

# Float noise guard: a scaled side meant to land exactly on a tile or patch boundary
# (1800x2400 -> 1056 px = 33 patches) must not count an extra tile for 1056.0000000001.
_EPS = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def _check(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError("image sides must be positive")


# --------------------------------------------------------------------------- OpenAI
# Source: OpenAI "Images and vision" guide, "Calculating costs" (platform.openai.com/docs/
# guides/vision), as quoted in OpenAI community threads (community.openai.com, 2025) and
# third-party calculators; the worked examples below are the guide's own.


def openai_tile_tokens(
    width: int, height: int, detail: str = "high", *, base: int = 85, per_tile: int = 170
) -> int:
    """GPT-4o-style tile models: 85 for detail=low; high: fit 2048x2048, shortest side to
    768 (never upscaled), then 85 + 170 per 512 px tile. 1024x1024 -> 768x768 -> 4 tiles -> 765.
    """
    _check(width, height)
    if detail == "low":
        return base
    if detail not in ("high", "auto"):
        raise ValueError(f"detail must be 'low', 'high' or 'auto', not {detail!r}")
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        scale = 2048 / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > 768:
        scale = 768 / min(w, h)
        w, h = w * scale, h * scale
    return base + per_tile * _ceil(w / 512) * _ceil(h / 512)


def openai_patch_tokens(
    width: int, height: int, *, multiplier: float = 1.0, max_patches: int = 1536
) -> int:
    """Patch models (gpt-4.1-mini/nano, o4-mini): 32x32 px patches, at most 1536.

    An image needing more is shrunk to fit (scale sqrt(32*32*1536 / (w*h)), then adjusted so
    the narrower dimension ends on a whole patch), and the patch count is multiplied by a
    per-model factor. 1800x2400 -> 1056x1408 -> 33 x 44 = 1452 patches.
    How the product is rounded is not published; this rounds up.
    """
    _check(width, height)
    patches = _ceil(width / 32) * _ceil(height / 32)
    if patches > max_patches:
        r = math.sqrt(32 * 32 * max_patches / (width * height))
        w_units, h_units = width * r / 32, height * r / 32
        r *= min(math.floor(w_units) / w_units, math.floor(h_units) / h_units)
        patches = _ceil(width * r / 32) * _ceil(height * r / 32)
    return _ceil(min(patches, max_patches) * multiplier)


# Per-model multipliers for patch models. OpenAI's vision guide (2025): gpt-4.1-mini 1.62,
# gpt-4.1-nano 2.46, o4-mini 1.72 — confirmed only through third-party copies of the guide
# (OpenAI community, a64.in calculator); OpenAI's own page was not reachable from here.
OPENAI_PATCH_MULTIPLIERS = {"gpt-4.1-mini": 1.62, "gpt-4.1-nano": 2.46, "o4-mini": 1.72}


# --------------------------------------------------------------------------- Anthropic
# Source: Anthropic "Vision" docs (docs.anthropic.com/en/docs/build-with-claude/vision),
# "Evaluate image size": tokens ~= width * height / 750; an image whose long edge exceeds
# 1568 px, or that would exceed "~1,600 tokens", is first scaled down, keeping its aspect
# ratio. Their table: 200x200 ~54, 1000x1000 ~1334, 1092x1092 ~1590, and the largest sizes
# left alone per aspect ratio (1092x1092, 951x1268, 896x1344, 819x1456, 784x1568), so the
# area cap here is the largest of those, 784x1568 (~1640 tokens).

ANTHROPIC_MAX_EDGE = 1568
ANTHROPIC_MAX_PIXELS = 784 * 1568


def anthropic_tokens(width: int, height: int) -> int:
    _check(width, height)
    scale = min(
        1.0,
        ANTHROPIC_MAX_EDGE / max(width, height),
        math.sqrt(ANTHROPIC_MAX_PIXELS / (width * height)),
    )
    if scale < 1.0:
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
    return math.ceil(width * height / 750)


# --------------------------------------------------------------------------- Google Gemini
# Source: Google Vertex AI / Firebase "input file requirements" (firebase.google.com/docs/
# vertex-ai/input-file-requirements) and ai.google.dev/gemini-api/docs/tokens (2025):
# images larger than 3072x3072 are scaled down (aspect kept); both sides <= 384 px -> 258
# tokens; otherwise the image is cut into square crops whose side (the "crop unit") is the
# shorter side / 1.5, clamped to 256..768, each crop resized to 768x768 and costing 258.
# ai.google.dev words it as "tiles of 768x768"; the crop-unit rule is the precise one.
# Caveat: Gemini 2.5+ bills by `media_resolution` and has been observed to report a flat
# 258 per image (googleapis/python-genai issue 1349); this follows the documented rule.


def gemini_tokens(width: int, height: int) -> int:
    _check(width, height)
    if max(width, height) > 3072:
        scale = 3072 / max(width, height)
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
    if width <= 384 and height <= 384:
        return 258
    unit = min(768, max(256, math.floor(min(width, height) / 1.5)))
    return 258 * math.ceil(width / unit) * math.ceil(height / unit)


# --------------------------------------------------------------------------- prices


@dataclass(frozen=True)
class Offer:
    provider: str
    model: str
    usd_per_million_input: float
    tokens: Callable[..., int]
    source: str
    takes_detail: bool = False  # its tokens(width, height, detail) tells "low" from "high"


def _patch(model: str) -> Callable[[int, int], int]:
    multiplier = OPENAI_PATCH_MULTIPLIERS[model]
    return lambda w, h: openai_patch_tokens(w, h, multiplier=multiplier)


# Standard (non-batch, uncached) input prices in USD per million tokens, as published in the
# sources named; looked up 2026-11-30. Prices move: re-check before quoting them.
PRICES_AS_OF = "2026-11-30"
OFFERS: tuple[Offer, ...] = (
    # openai.com/api/pricing as tabulated by deploybase.ai "OpenAI pricing" (March 2026)
    # and aumiqx.com "OpenAI API pricing" (April 2026).
    Offer("OpenAI", "gpt-4o", 2.50, openai_tile_tokens, "OpenAI pricing, via deploybase.ai 2026-03", takes_detail=True),
    Offer("OpenAI", "gpt-4.1-mini", 0.40, _patch("gpt-4.1-mini"), "OpenAI pricing, via deploybase.ai 2026-03"),
    Offer("OpenAI", "gpt-4.1-nano", 0.10, _patch("gpt-4.1-nano"), "OpenAI pricing, via deploybase.ai 2026-03"),
    Offer("OpenAI", "o4-mini", 1.10, _patch("o4-mini"), "OpenAI pricing, via deploybase.ai 2026-03"),
    # docs.anthropic.com/en/docs/about-claude/pricing (Sonnet $3; 2025) and deploybase.ai
    # "Claude API pricing" (2026-03-21: Sonnet 4.5 $3, Haiku 4.5 $1).
    Offer("Anthropic", "claude-sonnet-4-5", 3.00, anthropic_tokens, "Anthropic pricing, via deploybase.ai 2026-03-21"),
    Offer("Anthropic", "claude-haiku-4-5", 1.00, anthropic_tokens, "Anthropic pricing, via deploybase.ai 2026-03-21"),
    # ai.google.dev/gemini-api/docs/pricing as tabulated by deploybase.ai "Gemini 2.5
    # pricing" (2026-03): 2.5 Pro $1.25 (prompts <= 200k tokens), 2.5 Flash $0.30.
    Offer("Google Gemini", "gemini-2.5-pro", 1.25, gemini_tokens, "Gemini API pricing, via deploybase.ai 2026-03"),
    Offer("Google Gemini", "gemini-2.5-flash", 0.30, gemini_tokens, "Gemini API pricing, via deploybase.ai 2026-03"),
)


def commercial_costs(width: int, height: int, detail: str | None = None) -> list[dict]:
    """Tokens and list-price USD for one `width` x `height` image on each offer above.

    `detail` as in an image part: OpenAI's tile models charge 85 tokens for "low", and count
    "high" (also what "auto" gives a large image) otherwise; the other offers have no detail.
    """
    _check(width, height)
    detail = "low" if detail == "low" else "high"
    rows = []
    for offer in OFFERS:
        tokens = offer.tokens(width, height, detail) if offer.takes_detail else offer.tokens(width, height)
        rows.append({
            "provider": offer.provider,
            "model": offer.model,
            "tokens": tokens,
            # Decimal, rounded like our own prices (to a millionth of a dollar), never float noise.
            "usd": (Decimal(tokens) * Decimal(str(offer.usd_per_million_input)) / 1_000_000).quantize(
                Decimal("0.000001"), rounding=ROUND_HALF_EVEN),
        })
    return rows
