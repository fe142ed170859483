from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.tenants.models import ApiKey, Tenant

KEY_PREFIX = "vlm-"


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    secret: str  # the only time the full key exists outside the client


def key_hash(secret: str) -> str:
    # Keys carry 190+ bits of randomness, so a fast hash is enough; no stretching needed.
    return hashlib.sha256(secret.encode()).hexdigest()


def api_key_create(
    *, tenant: Tenant, name: str = "", created_by=None, expires_at: datetime | None = None
) -> IssuedKey:
    for attempt in range(5):
        prefix = secrets.token_hex(4)  # 32 bits: collisions are rare, not impossible
        secret = f"{KEY_PREFIX}{prefix}-{secrets.token_urlsafe(32)}"
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant,
                    name=name,
                    prefix=prefix,
                    key_hash=key_hash(secret),
                    created_by=created_by,
                    expires_at=expires_at,
                )
        except IntegrityError:
            if attempt == 4:
                raise
            continue
        return IssuedKey(api_key=api_key, secret=secret)
    raise AssertionError("unreachable")


def api_key_revoke(*, api_key: ApiKey) -> None:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])


def api_key_lookup(secret: str) -> ApiKey | None:
    """The usable key for `secret`, or None. Unknown, revoked and expired keys look alike."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200:
        return None
    digest = key_hash(secret)
    api_key = ApiKey.objects.select_related("tenant", "tenant__quota").filter(key_hash=digest).first()
    if api_key is None or not hmac.compare_digest(api_key.key_hash, digest):
        return None
    return api_key if api_key.is_usable() else None
