"""What the gateway needs per request, read from the database and cached for seconds.

Keys, tiers and healthy instances change rarely; caching them keeps the database off the
hot path. A revoked key stops working once its cache entry expires
(GATEWAY_KEY_CACHE_SECONDS).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from controlplane.catalog.engine_settings import EngineSettingsError
from controlplane.catalog.models import ModelTier, TierTokenizer
from controlplane.fleet.selectors import failing_instance_ids, routable_instances
from controlplane.gateway.apps import current_process
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.ledger import MICROS, Limits
from controlplane.gateway.prepare import TierSpec
from controlplane.gateway.rules import Rule
from controlplane.gateway.ttl_cache import TTLCache
from controlplane.imaging.fetch import FetchPolicy
from controlplane.imaging.tokens import processor_options
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import Rates
from controlplane.prompts import ChatTokenizer
from controlplane.tenants.models import RoutingRule, usable_tier_ids
from controlplane.tenants.services import api_key_find

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    tenant_id: int
    tenant_name: str
    cache_salt: str | None
    allowed_tier_ids: frozenset[int] | None  # None: every enabled tier
    limits: Limits | None = None  # None: no quota
    default_text_tier_id: int | None = None  # the tenant's own `auto` (catalog/routing.py)
    default_image_tier_id: int | None = None
    key_requests_per_minute: int | None = None  # the key's own limit, within the tenant's quota
    capture: bool = False  # keep its requests' bodies and answers for debugging (gateway/capture.py)
    rules: tuple[Rule, ...] = ()  # what `auto` reads first: the key's routing rules, its tenant's, the defaults


@dataclass(frozen=True)
class RefusedKey:
    """A key of ours that cannot be used now: its requests are refused, and kept in its
    tenant's usage so that its holder and the operators can see why."""

    key_id: int
    tenant_id: int
    reason: str  # ApiKey.refusal(): "revoked", "tenant_inactive" or "expired"


@dataclass(frozen=True)
class InstanceSpec:
    id: int
    tier_id: int
    base_url: str
    pool: str
    api_key: str = ""
    queued: float = 0.0  # the engine's own running + waiting requests, from its last scrape
    model: str = ""  # the name it serves its model under, when not the tier's


_MISSING = object()


class Caches:
    """What one process read from the database, kept for a few seconds (keys for
    GATEWAY_KEY_CACHE_SECONDS), and the tiers' tokenizers, built again only when they change."""

    def __init__(self):
        self.keys = TTLCache(settings.GATEWAY_KEY_CACHE_SECONDS)
        self.tiers = TTLCache(5)
        self.instances = TTLCache(2)
        self.failing = TTLCache(2)
        self.tokenizers: dict[int, tuple[str, object]] = {}  # tier id -> (digest, ChatTokenizer)

    def clear(self) -> None:
        for cache in (self.keys, self.tiers, self.instances, self.failing):
            cache.clear()


def clear_caches() -> None:
    """Forget what this process read (the next requests read afresh)."""
    current_process().caches.clear()


def micros(amount) -> int | None:
    """A budget's amount in micro-units (None: no budget)."""
    return None if amount is None else int(amount * MICROS)


def _salt(tenant_name: str) -> str:
    return hashlib.sha256(f"{settings.SECRET_KEY}:tenant:{tenant_name}".encode()).hexdigest()[:32]


def _load_key(secret: str) -> KeyInfo | RefusedKey | None:
    api_key = api_key_find(secret)
    if api_key is None:
        return None
    refusal = api_key.refusal()
    if refusal is not None:
        return RefusedKey(key_id=api_key.pk, tenant_id=api_key.tenant_id, reason=refusal)
    # Mark use at most once a minute per key: a write per request would put the DB on the hot path.
    now = timezone.now()
    if api_key.last_used_at is None or (now - api_key.last_used_at).total_seconds() > 60:
        type(api_key).objects.filter(pk=api_key.pk).update(last_used_at=now)
    return key_info_of(api_key)


def key_info_of(api_key) -> KeyInfo:
    """What the gateway knows of a usable `api_key` (the console's dry run asks it too)."""
    tenant = api_key.tenant
    allowed = usable_tier_ids(api_key)
    quota = getattr(tenant, "quota", None)
    limits = Limits(key_spend=micros(api_key.spend_limit))
    if quota is not None:
        limits = Limits(period=quota.period, image_tokens=quota.image_tokens, total_tokens=quota.total_tokens,
                        requests_per_minute=quota.requests_per_minute,
                        concurrent_large_images=quota.concurrent_large_images,
                        spend=micros(quota.spend_limit) if quota.spend_hard else None,
                        key_spend=limits.key_spend, currency=quota.spend_currency)
    return KeyInfo(
        key_id=api_key.pk,
        tenant_id=tenant.pk,
        tenant_name=tenant.name,
        cache_salt=_salt(tenant.name) if tenant.isolate_prefix_cache else None,
        allowed_tier_ids=allowed or None,
        limits=None if limits is None or limits.unlimited else limits,
        default_text_tier_id=tenant.default_text_tier_id,
        default_image_tier_id=tenant.default_image_tier_id,
        key_requests_per_minute=api_key.requests_per_minute,
        capture=tenant.capture_bodies or api_key.capture_bodies,
        rules=_rules(api_key),
    )


def _rules(api_key) -> tuple[Rule, ...]:
    """The enabled routing rules `api_key`'s requests for `auto` read, in the order they are
    read: its own, its tenant's, then the defaults."""
    rows = RoutingRule.objects.filter(enabled=True).filter(
        Q(api_key=api_key) | Q(tenant=api_key.tenant_id, api_key=None) | Q(tenant=None, api_key=None))
    scopes = {api_key.pk: f"key {api_key.prefix}…"}
    order = sorted(rows, key=lambda row: (0 if row.api_key_id else 1 if row.tenant_id else 2, row.position, row.pk))
    return tuple(Rule.of(row, scopes.get(row.api_key_id) or (f"tenant {api_key.tenant.name}" if row.tenant_id
                                                              else "default")) for row in order)


async def key_info(secret: str) -> KeyInfo | RefusedKey | None:
    """What the gateway knows of `secret`: a usable key, a key it refuses, or None (no key of ours)."""
    digest = hashlib.sha256(secret.encode()).digest()
    cached = await current_process().caches.keys.fetch(digest, lambda: _load_key(secret) or _MISSING)
    return None if cached is _MISSING else cached


def _tier_tokenizers(tier_ids) -> dict:
    """Each tier's ChatTokenizer, built again only when its files changed (a Qwen
    tokenizer.json is megabytes: the cache refresh reads only the digests)."""
    found, built = {}, current_process().caches.tokenizers
    for tier_id, digest in TierTokenizer.objects.filter(tier_id__in=tier_ids).values_list("tier_id", "digest"):
        cached = built.get(tier_id)
        if cached is None or cached[0] != digest:
            row = TierTokenizer.objects.get(tier_id=tier_id)
            try:
                cached = (digest, ChatTokenizer(row.tokenizer_json, row.chat_template, special=row.special_tokens))
            except Exception:  # noqa: BLE001 - a broken upload: the estimate serves instead
                log.exception("the tokenizer of tier %s does not load", tier_id)
                cached = (digest, None)
            built[tier_id] = cached
        found[tier_id] = cached[1]
    return found


def _load_tiers() -> dict[str, TierSpec]:
    specs = {}
    tiers = list(ModelTier.objects.filter(enabled=True).select_related("resolution_policy"))
    tokenizers = _tier_tokenizers([t.pk for t in tiers])
    book, now = RateBook().load({tier.price_plan_id for tier in tiers}), timezone.now()
    for tier in tiers:
        policy = tier.image_policy()
        options = (
            processor_options(tier.family, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)
            if policy else {}
        )
        try:
            engine = tier.settings
        except EngineSettingsError as exc:  # saved past the model's checks: not served, and said why
            log.error("tier %s is not served: its engine settings cannot be used: %s", tier.name, exc)
            continue
        fetch = None
        if policy is not None and engine.fetch_image_urls:
            fetch = FetchPolicy(
                max_bytes=settings.GATEWAY_IMAGE_FETCH_MAX_BYTES,
                timeout_s=settings.GATEWAY_IMAGE_FETCH_TIMEOUT_S,
                allowed_domains=engine.allowed_media_domains,
                trusted_networks=tuple(settings.GATEWAY_TRUSTED_IMAGE_NETWORKS),
            )
        try:
            rate = book.rate_at(tier.price_plan_id, now)
        except NoRate:
            rate = None
        specs[tier.name] = TierSpec(
            id=tier.pk,
            name=tier.name,
            family=tier.family,
            kind=tier.kind,
            policy=policy,
            processor_options=options,
            large_image_threshold=tier.large_image_threshold,
            max_output_tokens=engine.max_output_tokens,
            max_model_len=engine.max_model_len,
            priority_scheduling=engine.scheduling_policy == "priority",
            require_moderation=engine.require_moderation,
            large_image_concurrency=engine.large_image_concurrency,
            image_prefill_slots=engine.image_prefill_slots,
            price_plan_id=tier.price_plan_id,
            fetch_policy=fetch,
            tool_calls=bool(engine.tool_call_parser),
            tokenizer=tokenizers.get(tier.pk),
            priced=rate is not None,
            rates=None if rate is None else Rates.of(rate),
            currency="" if rate is None else rate.plan.currency,
            default_for_text=tier.default_for_text,
            default_for_images=tier.default_for_images,
        )
    return specs


async def tiers() -> dict[str, TierSpec]:
    return await current_process().caches.tiers.fetch("all", _load_tiers)


def _load_instances(tier_id: int) -> list[InstanceSpec]:
    return [
        InstanceSpec(id=i.pk, tier_id=i.tier_id, base_url=i.base_url, pool=i.pool, api_key=i.api_key,
                     queued=i.num_running + i.num_waiting, model=i.served_model_name)
        for i in routable_instances(tier_id=tier_id)
    ]


async def instances(tier_id: int) -> list[InstanceSpec]:
    return await current_process().caches.instances.fetch(tier_id, lambda: _load_instances(tier_id))


async def failing(tier_id: int) -> set[int]:
    """Instances of the tier supervision found hung or dead (see failing_instance_ids)."""
    return await current_process().caches.failing.fetch(tier_id, lambda: failing_instance_ids(tier_id=tier_id))


async def read_or_unavailable(what: str, fetching):
    """What the gateway reads from the database (through its caches), or a 503 when it can
    neither read it nor serve what it knew."""
    try:
        return await fetching
    except Exception:
        log.exception("%s cannot be read", what)
        raise GatewayError(503, f"{what} cannot be read right now; retry shortly", code="service_unavailable",
                           headers={"Retry-After": "5"}) from None
