"""What a resolution policy does to an image, for every vision tier, at today's prices."""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import normalise_tiles, sent_sizes
from controlplane.imaging.tokens import count_image_tokens, processor_options
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


def vision_tiers():
    return ModelTier.objects.filter(kind=ModelTier.Kind.VISION, enabled=True).select_related(
        "resolution_policy", "price_plan").order_by("name")


def tier_image_tokens(tier: ModelTier, width: int, height: int) -> int:
    policy = tier.resolution_policy
    options = processor_options(tier.family, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)
    return count_image_tokens(tier.family, width, height, **options)


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


def resolution_curve(tier: ModelTier, *, aspect=(4, 3), megapixels=(0.1, 0.25, 0.5, 1, 2, 4, 8, 12)):
    """Image tokens against source megapixels for `tier`'s policy (a 4:3 photo by default)."""
    policy = tier.image_policy()
    points = []
    for mp in megapixels:
        height = round((mp * 1e6 * aspect[1] / aspect[0]) ** 0.5)
        width = round(height * aspect[0] / aspect[1])
        points.append((mp, sum(tier_image_tokens(tier, *sent) for sent in sent_sizes(width, height, policy))))
    return points


def resolution_curves(*, tier=None) -> dict[str, list[tuple[float, int]]]:
    """Image tokens against source resolution under each vision tier's policy (or `tier`'s)."""
    tiers = vision_tiers()
    if tier is not None:
        tiers = tiers.filter(pk=tier.pk)
    return {t.name: resolution_curve(t) for t in tiers}
