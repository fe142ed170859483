"""What the model name `auto` resolves to: the one rule, used by the gateway and shown on the
tier and key pages.

A request with images goes to its tenant's default image tier, else to the tier marked as the
default for images; a text request to its tenant's default text tier, else to the tier marked
as the default for text, else (a vision model reads text too) where an image request would go.
Only tiers the key may use count. Nothing is chosen by name order: with no default set, `auto`
is refused with a message saying so, so that adding a tier never moves anyone's traffic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from controlplane.catalog.models import ModelTier


class Routable(Protocol):
    id: int
    kind: str
    default_for_text: bool
    default_for_images: bool


def resolve_auto(tiers: Iterable[Routable], *, has_images: bool, tenant_text_tier_id: int | None = None,
                 tenant_image_tier_id: int | None = None):
    """The tier of `tiers` (those the key may use) that `auto` means, or None."""
    by_id = {tier.id: tier for tier in tiers}
    wanted = ("images",) if has_images else ("text", "images")
    for kind in wanted:
        chosen = by_id.get(tenant_image_tier_id if kind == "images" else tenant_text_tier_id)
        if chosen is not None and (kind == "text" or chosen.kind == "vision"):
            return chosen
        marked = [t for t in by_id.values() if (t.default_for_images if kind == "images" else t.default_for_text)]
        if marked:
            return marked[0]
    return None


def tenant_auto(tenant, *, enabled_tiers: Iterable | None = None) -> dict:
    """Where `auto` sends `tenant`'s text and image requests now: {"text": tier or None, ...}.
    A page of many tenants reads the enabled tiers once and gives them as `enabled_tiers`,
    and prefetches each tenant's allowed tiers."""
    tiers = ModelTier.objects.filter(enabled=True) if enabled_tiers is None else enabled_tiers
    allowed = {tier.id for tier in tenant.allowed_tiers.all()}
    usable = [tier for tier in tiers if not allowed or tier.id in allowed]
    return {kind: resolve_auto(usable, has_images=kind == "images", tenant_text_tier_id=tenant.default_text_tier_id,
                               tenant_image_tier_id=tenant.default_image_tier_id) for kind in ("text", "images")}
