"""Which tier a request asked for: by name, or `auto` (the key's or tenant's default for text or
for images), within the tiers its key may use."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from controlplane.catalog.routing import resolve_auto
from controlplane.gateway import state
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.prepare import TierSpec
from controlplane.gateway.rules import Facts, Rule, SizingLimits, decide

AUTO = "auto"


@dataclass(frozen=True)
class Choice:
    """The tier a request goes to, and, when a routing rule chose it, the rule and the tier a
    cascade escalates to."""

    tier: TierSpec
    rule: Rule | None = None
    escalate_to: TierSpec | None = None


def needs_sizes(model: str, key: state.KeyInfo, facts: Facts) -> bool:
    """Whether choosing the tier (or reserving for a cascade) reads the pictures' sizes."""
    return model == AUTO and bool(facts.parts) and any(rule.looks_at_pictures for rule in key.rules)


def sizing_limits() -> SizingLimits:
    """What reading a request's picture headers may cost, as the decode settings say."""
    return SizingLimits(cpu_seconds=settings.GATEWAY_REQUEST_IMAGE_CPU_MS / 1000,
                        max_scans=settings.GATEWAY_IMAGE_MAX_SCANS)


def allowed_tiers(key: state.KeyInfo, tiers: dict[str, TierSpec]) -> list[TierSpec]:
    return [t for t in tiers.values() if key.allowed_tier_ids is None or t.id in key.allowed_tier_ids]



def auto_tier(key: state.KeyInfo, allowed: list[TierSpec], *, has_images: bool) -> TierSpec | None:
    return resolve_auto(allowed, has_images=has_images, tenant_text_tier_id=key.default_text_tier_id,
                        tenant_image_tier_id=key.default_image_tier_id)


def tier_asked(model: str, key: state.KeyInfo, tiers: dict[str, TierSpec], has_images: bool,
               facts: Facts | None = None) -> Choice:
    allowed = allowed_tiers(key, tiers)
    if model == AUTO:
        if key.rules and facts is not None:
            decision = decide(key.rules, facts, {tier.id: tier for tier in allowed})
            if decision is not None:
                return Choice(decision.tier, decision.rule, decision.escalate_to)
        tier = auto_tier(key, allowed, has_images=has_images)
        if tier is None:
            kind = "image" if has_images else "text"
            raise GatewayError(404, f"no default {kind} model is set for this key, so 'auto' means nothing: "
                               "ask for a model by name (GET /v1/models lists them)",
                               code="model_not_found", param="model")
        return Choice(tier)
    tier = tiers.get(model)
    if tier is None:
        raise GatewayError(404, f"the model '{model}' does not exist", code="model_not_found",
                           param="model")
    if tier not in allowed:
        raise GatewayError(403, f"this API key may not use the model '{model}'",
                           code="model_not_allowed", param="model")
    return Choice(tier)
