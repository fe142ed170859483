"""What one image would cost on each vision tier today: its sizes after the tier's policy, its
tokens, and its price at the rate in effect (the tier policy page's drop-in preview)."""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.catalog.services import tier_image_tokens, vision_tiers
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import normalise_tiles
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import images_price


@dataclass(frozen=True)
class TierPreview:
    tier: ModelTier
    sizes: list[tuple[int, int]]  # one per image sent to the engine (tiles of a long image)
    image_tokens: int
    cost: object  # Decimal, in the plan's currency
    currency: str
    error: str = ""


def policy_preview(*, data: bytes, detail: str | None = None) -> list[TierPreview]:
    """Each vision tier's treatment of one image: sizes after its policy, tokens and cost."""
    now, book = timezone.now(), RateBook()
    previews = []
    for tier in vision_tiers():
        try:
            tiles = normalise_tiles(data, tier.image_policy(), detail=detail)
        except ImageError as exc:
            previews.append(TierPreview(tier, [], 0, None, tier.price_plan.currency, error=str(exc)))
            continue
        each = [tier_image_tokens(tier, t.width, t.height) for t in tiles]
        tokens = sum(each)
        try:
            cost = images_price(each, book.rates_at(tier.price_plan_id, now))
        except NoRate:
            cost = None  # shown as "no price in effect"
        previews.append(TierPreview(tier, [(t.width, t.height) for t in tiles], tokens, cost,
                                    tier.price_plan.currency))
    return previews
