"""What a resolution policy does to an image: its sizes and tokens on every vision tier."""

from __future__ import annotations

from controlplane.catalog.models import ModelTier
from controlplane.imaging.policy import sent_sizes
from controlplane.imaging.tokens import count_image_tokens, processor_options


def vision_tiers():
    return ModelTier.objects.filter(kind=ModelTier.Kind.VISION, enabled=True).select_related(
        "resolution_policy", "price_plan").order_by("name")


def tier_image_tokens(tier: ModelTier, width: int, height: int) -> int:
    policy = tier.resolution_policy
    options = processor_options(tier.family, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)
    return count_image_tokens(tier.family, width, height, **options)


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
