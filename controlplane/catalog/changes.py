"""Changes to tiers made by people, each recorded with who made it."""

from __future__ import annotations

from django.db import transaction

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, field_values
from controlplane.catalog.models import ModelTier

AUDITED = ("name", "display_name", "kind", "family", "model_id", "engine_kind", "engine_settings",
           "resolution_policy_id", "price_plan_id", "large_image_threshold", "replicas", "gpus_per_replica",
           "enabled", "default_for_text", "default_for_images")


def _before(tier: ModelTier) -> dict:
    if tier.pk is None:
        return {}
    return field_values(ModelTier.objects.get(pk=tier.pk), AUDITED)


@transaction.atomic
def tier_save(*, tier: ModelTier, actor: str, note: str = "") -> ModelTier:
    """Save a tier that passed its checks (full_clean), recording what changed (and `note`, say
    the quality check that measured the change). Marking it the default for text or images takes
    the mark from the tier that had it (recorded too)."""
    created, before = tier.pk is None, _before(tier)
    for flag in ("default_for_text", "default_for_images"):
        if getattr(tier, flag):
            for previous in ModelTier.objects.select_for_update().filter(**{flag: True}).exclude(pk=tier.pk):
                was = field_values(previous, AUDITED)
                setattr(previous, flag, False)
                previous.save(update_fields=[flag])
                audit_record(actor=actor, action=AuditEntry.Action.CHANGED, obj=previous, before=was,
                             after=field_values(previous, AUDITED))
    tier.save()
    after = field_values(tier, AUDITED)
    if note:
        before, after = {**before, "quality_check": None}, {**after, "quality_check": note}
    audit_record(actor=actor, action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                 obj=tier, before=before, after=after)
    return tier


@transaction.atomic
def tier_set_enabled(*, tier: ModelTier, enabled: bool, actor: str) -> ModelTier:
    """Enable a tier (refused, as ValidationError, without a price in effect) or disable it."""
    tier.enabled = enabled
    tier.full_clean()
    return tier_save(tier=tier, actor=actor)
