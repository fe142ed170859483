from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, field_values, history
from controlplane.tenants.models import (
    ApiKey,
    Quota,
    QuotaDefault,
    QuotaLimits,
    RoutingRule,
    Tenant,
)

KEY_PREFIX = "vlm-"


class TenantInactive(Exception):
    """No key is made for a deactivated tenant: it would start working when the tenant is
    reactivated, though nobody could have made it while it was."""

    def __init__(self, tenant: Tenant):
        super().__init__(f"{tenant.name} is deactivated: no key can be made for it")


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    secret: str  # the only time the full key exists outside the client


def key_hash(secret: str) -> str:
    # Keys carry 190+ bits of randomness, so a fast hash is enough; no stretching needed.
    return hashlib.sha256(secret.encode()).hexdigest()


INTERNAL_TENANT = "internal"


def internal_tenant() -> Tenant:
    """The tenant the service's own traffic through the gateway is metered to (benchmark runs
    aimed at a tier, the playground): kept out of finance totals and statements unless asked
    for. What is sent straight to an engine is metered nowhere, as no gateway sees it: quality
    gate checks (benchmarks/gates.py) and benchmark runs aimed at one engine."""
    found = Tenant.objects.filter(internal=True).order_by("pk").first()
    if found is None:
        taken = set(Tenant.objects.filter(name__startswith=INTERNAL_TENANT).values_list("name", flat=True))
        name = next(name for n in range(len(taken) + 1) if (name := f"{INTERNAL_TENANT}{f'-{n}' if n else ''}")
                    not in taken)  # a client's tenant may be called "internal": never metered to it
        found = Tenant.objects.create(name=name, display_name="The service's own traffic", internal=True)
    return found


def _new_secret() -> tuple[str, str]:
    """A key's prefix and secret: 32 bits of prefix (collisions are rare, not impossible)."""
    prefix = secrets.token_hex(4)
    return prefix, f"{KEY_PREFIX}{prefix}-{secrets.token_urlsafe(32)}"


def api_key_create(
    *, tenant: Tenant, name: str = "", created_by=None, expires_at: datetime | None = None, tiers=None,
    requests_per_minute: int | None = None, spend_limit=None,
) -> IssuedKey:
    """A new key of `tenant`; `tiers`, when given, scopes it to those models. TenantInactive
    when the tenant is deactivated."""
    for attempt in range(5):
        prefix, secret = _new_secret()
        try:
            with transaction.atomic():
                # Locked: a deactivation saved meanwhile waits for the key, or the key for it.
                if Tenant.objects.select_for_update().filter(pk=tenant.pk, active=True).first() is None:
                    raise TenantInactive(tenant)
                api_key = ApiKey.objects.create(
                    tenant=tenant,
                    name=name,
                    prefix=prefix,
                    key_hash=key_hash(secret),
                    created_by=created_by,
                    expires_at=expires_at,
                    requests_per_minute=requests_per_minute,
                    spend_limit=spend_limit,
                )
        except IntegrityError:
            if attempt == 4:
                raise
            continue
        if tiers:
            api_key.allowed_tiers.set(tiers)
        _key_audit(api_key, created_by, created=True)
        return IssuedKey(api_key=api_key, secret=secret)
    raise AssertionError("unreachable")


def api_key_revoke(*, api_key: ApiKey, actor=None) -> None:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
        _key_audit(api_key, actor, created=False)


def _key_fields(api_key: ApiKey) -> dict:
    """What an audit entry records of a key."""
    return {"tenant": api_key.tenant.name, "name": api_key.name, "prefix": api_key.prefix,
            "models": ", ".join(sorted(api_key.allowed_tiers.values_list("name", flat=True)))
            or "every model of its tenant", "requests_per_minute": api_key.requests_per_minute,
            "spend_limit": str(api_key.spend_limit) if api_key.spend_limit is not None else None,
            "expires_at": api_key.expires_at.isoformat() if api_key.expires_at else None,
            "capture_bodies": api_key.capture_bodies}


def _key_audit(api_key: ApiKey, user, *, created: bool) -> None:
    who = getattr(user, "username", None) or (user if isinstance(user, str) else "")
    if created:
        audit_record(actor=who, action=AuditEntry.Action.CREATED, obj=api_key, after=_key_fields(api_key))
    else:
        audit_record(actor=who, action=AuditEntry.Action.CHANGED, obj=api_key, before={"revoked_at": None},
                     after={"revoked_at": api_key.revoked_at.isoformat()})


KEY_EDITABLE = ("name", "requests_per_minute", "spend_limit", "expires_at", "capture_bodies")


class KeyRevoked(Exception):
    def __init__(self, api_key: ApiKey):
        super().__init__(f"key {api_key.prefix}… is revoked: make a new one")


@transaction.atomic
def api_key_update(*, api_key: ApiKey, values: dict, tiers, actor) -> ApiKey:
    """Change a key's name, models, limits and expiry (checked by its form), recording the
    change. The gateway applies it within GATEWAY_KEY_CACHE_SECONDS."""
    api_key = ApiKey.objects.select_for_update().select_related("tenant").get(pk=api_key.pk)
    if api_key.revoked_at is not None:
        raise KeyRevoked(api_key)
    before = _key_fields(api_key)
    changed = [name for name in KEY_EDITABLE if name in values]  # capture_bodies: an operator's only
    for name in changed:
        setattr(api_key, name, values[name])
    api_key.save(update_fields=changed)
    api_key.allowed_tiers.set(tiers or [])
    audit_record(actor=getattr(actor, "username", None) or str(actor), action=AuditEntry.Action.CHANGED,
                 obj=api_key, before=before, after=_key_fields(api_key))
    return api_key


@transaction.atomic
def api_key_rotate(*, api_key: ApiKey, actor) -> IssuedKey:
    """A new secret for the same key: its name, models, limits, budget, spend and history stay;
    the old secret stops working (within GATEWAY_KEY_CACHE_SECONDS, as a revoked key does)."""
    api_key = ApiKey.objects.select_for_update().select_related("tenant").get(pk=api_key.pk)
    if api_key.revoked_at is not None:
        raise KeyRevoked(api_key)
    if not api_key.tenant.active:
        raise TenantInactive(api_key.tenant)
    before = api_key.prefix
    for _attempt in range(5):
        prefix, secret = _new_secret()
        if not ApiKey.objects.filter(prefix=prefix).exists():
            break
    api_key.prefix, api_key.key_hash = prefix, key_hash(secret)
    api_key.save(update_fields=["prefix", "key_hash"])
    audit_record(actor=getattr(actor, "username", None) or str(actor), action=AuditEntry.Action.CHANGED,
                 obj=api_key, before={"prefix": before, "secret": "replaced"}, after={"prefix": prefix,
                                                                                     "secret": "new"})
    return IssuedKey(api_key=api_key, secret=secret)


def api_key_lookup(secret: str) -> ApiKey | None:
    """The usable key for `secret`, or None. Unknown, revoked and expired keys look alike."""
    api_key = api_key_find(secret)
    return api_key if api_key is not None and api_key.is_usable() else None


def api_key_find(secret: str) -> ApiKey | None:
    """The key `secret` is, usable or not (its `refusal()` says), with its tenant; None when
    it is no key of ours."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200:
        return None
    digest = key_hash(secret)
    api_key = ApiKey.objects.select_related("tenant", "tenant__quota").filter(key_hash=digest).first()
    if api_key is None or not hmac.compare_digest(api_key.key_hash, digest):
        return None
    return api_key


TENANT_AUDITED = ("name", "display_name", "active", "isolate_prefix_cache", "default_text_tier_id",
                  "default_image_tier_id", "capture_bodies")
QUOTA_AUDITED = QuotaLimits.SETTINGS


@transaction.atomic
def tenant_save(*, tenant: Tenant, tiers: list | None, quota: dict | None, actor: str) -> Tenant:
    """Save a tenant (checked by its form) with the tiers it may use (None: every tier, present
    and future) and its quota (None: unlimited), recording each change with who made it."""
    created = tenant.pk is None
    before = {} if created else {**field_values(Tenant.objects.get(pk=tenant.pk), TENANT_AUDITED),
                                 "tiers": _tier_names(tenant)}
    if before.get("active") is False and tenant.active:
        _keys_made_while_inactive_revoke(tenant, actor)
    tenant.save()
    tenant.allowed_tiers.set(tiers or [])
    after = {**field_values(tenant, TENANT_AUDITED), "tiers": _tier_names(tenant)}
    audit_record(actor=actor, action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                 obj=tenant, before=before, after=after)
    existing = Quota.objects.filter(tenant=tenant).first()
    was = field_values(existing, QUOTA_AUDITED) if existing else {}
    if quota is None:
        if existing is not None:
            existing.delete()
            audit_record(actor=actor, action=AuditEntry.Action.DELETED, obj=existing, before=was)
        return tenant
    row = existing or Quota(tenant=tenant)
    for name in QUOTA_AUDITED:
        setattr(row, name, quota.get(name))
    row.save()
    audit_record(actor=actor, action=AuditEntry.Action.CHANGED if existing else AuditEntry.Action.CREATED,
                 obj=row, before=was, after=field_values(row, QUOTA_AUDITED))
    return tenant


def _keys_made_while_inactive_revoke(tenant: Tenant, actor: str) -> None:
    """Revoke the keys made since `tenant` was last deactivated, as it is reactivated: none
    can be made now, but some were before api_key_create checked, and they would start
    working with it."""
    since = history(tenant).filter(changes__active=[True, False]).values_list("at", flat=True).first()
    if since is None:
        return
    for api_key in ApiKey.objects.filter(tenant=tenant, created_at__gte=since, revoked_at__isnull=True):
        api_key_revoke(api_key=api_key, actor=actor)


def _tier_names(tenant: Tenant) -> str:
    names = sorted(tenant.allowed_tiers.values_list("name", flat=True))
    return ", ".join(names) if names else "every tier"


@transaction.atomic
def quota_default_set(*, values: dict, actor: str):
    """Set the quota new tenants start with."""
    row = QuotaDefault.objects.select_for_update().order_by("pk").first()
    was = field_values(row, QUOTA_AUDITED) if row else {}
    row = row or QuotaDefault()
    for name in QUOTA_AUDITED:
        setattr(row, name, values.get(name))
    row.save()
    audit_record(actor=actor, action=AuditEntry.Action.CHANGED if was else AuditEntry.Action.CREATED, obj=row,
                 before=was, after=field_values(row, QUOTA_AUDITED))
    return row


RULE_AUDITED = ("position", "name", "enabled", "tasks", "min_images", "max_images", "min_source_pixels",
                "max_source_pixels", "min_image_tokens", "max_image_tokens", "min_prompt_tokens",
                "max_prompt_tokens", "min_max_tokens", "max_max_tokens", "detail", "tools", "send_detail",
                "pixel_cap", "escalate_detail", "escalate_pixel_cap", "confidence", "threshold",
                "escalate_on_length", "escalate_on_refusal", "cascade_streams")


def _rule_fields(rule: RoutingRule) -> dict:
    """What an audit entry records of a routing rule: its scope, tiers by name, and the rest."""
    return {"scope": rule.scope, "tier": rule.tier.name,
            "escalate_to": rule.escalate_to.name if rule.escalate_to_id else None,
            **field_values(rule, RULE_AUDITED)}


@transaction.atomic
def routing_rule_save(*, rule: RoutingRule, actor: str) -> RoutingRule:
    """Save a routing rule (checked by its form), recording the change with who made it. The
    gateway reads it within GATEWAY_KEY_CACHE_SECONDS."""
    created = rule.pk is None
    saved = None if created else RoutingRule.objects.select_related(
        "tenant", "api_key", "tier", "escalate_to").filter(pk=rule.pk).first()
    before = {} if saved is None else _rule_fields(saved)
    rule.save()
    audit_record(actor=actor, action=AuditEntry.Action.CREATED if created else AuditEntry.Action.CHANGED,
                 obj=rule, before=before, after=_rule_fields(rule))
    return rule


@transaction.atomic
def routing_rule_delete(*, rule: RoutingRule, actor: str) -> None:
    before = _rule_fields(rule)
    audit_record(actor=actor, action=AuditEntry.Action.DELETED, obj=rule, before=before)
    rule.delete()
