"""Where a request would go, and by which rule, worked out by the gateway's own code: its body
read and checked as the gateway reads it, its facts, the key's rules and tiers as the gateway
loads them, and the same choice of tier. Nothing is sent, admitted or recorded."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from django.conf import settings

from controlplane.gateway import state
from controlplane.gateway.body import read_body
from controlplane.gateway.cascade import cascades
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.rules import TASK_HEADER, Facts
from controlplane.gateway.tier_choice import AUTO, needs_sizes, sizing_limits, tier_asked
from controlplane.gateway.validation import RequestInvalid, image_parts, validate_body
from controlplane.tenants.models import ApiKey, Tenant, tenant_tier_ids


class BodyInvalid(ValueError):
    """A body the gateway would refuse before choosing a tier (the message says why)."""


@dataclass(frozen=True)
class Outcome:
    """What the gateway would do with the request: send it to `tier` (as `sent`), by `rule`
    or by `auto` as before; cascade to `escalate_to`; or refuse it (`refused`)."""

    tier: str = ""
    sent: str = ""  # the tier as the rule sends to it: "vlm-lite, detail low, at most 1,003,520 px"
    rule: str = ""  # the rule's label, as the request log keeps it; "" when none held
    auto: bool = False  # the model asked for is `auto`
    escalate_to: str = ""
    threshold: float | None = None
    confidence: str = ""  # "mean" or "min"
    unpriced: tuple[str, ...] = ()  # tiers with no price in effect: the gateway refuses the request
    refused: str = ""


def request_body(text: str, *, image: bytes | None = None, image_type: str = "") -> dict:
    """The request the form describes, as the gateway would read it: BodyInvalid if it would
    be refused. `image`, when given, ends its last user message, as a data URL."""
    try:
        body = read_body(text.encode())
    except (ValueError, UnicodeEncodeError, RecursionError) as exc:
        raise BodyInvalid(f"not valid JSON: {exc}") from None
    if isinstance(body, dict):
        body.setdefault("model", AUTO)
        if image is not None:
            _add_image(body, image, image_type)
    try:
        validate_body(body)
    except RequestInvalid as exc:
        raise BodyInvalid(str(exc)) from None
    return body


def _add_image(body: dict, image: bytes, image_type: str) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # refused by its checks, saying why
    url = f"data:{image_type if image_type.startswith('image/') else 'image/jpeg'};base64,"
    part = {"type": "image_url", "image_url": {"url": url + base64.b64encode(image).decode()}}
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        messages.append({"role": "user", "content": [part]})
        return
    content = users[-1].get("content")
    if isinstance(content, list):
        content.append(part)
    else:
        users[-1]["content"] = [*([{"type": "text", "text": content}] if isinstance(content, str) else []), part]


def key_info(*, api_key: ApiKey | None, tenant: Tenant) -> state.KeyInfo:
    """What the gateway knows of `api_key` when it chooses a tier; with no key, of a key of
    `tenant`'s with no rules or scope of its own."""
    if api_key is not None:
        return state.key_info_of(api_key)
    # Saved-looking but no key's: no key's rules are read for it, only its tenant's and the defaults.
    api_key = ApiKey(pk=0, tenant=tenant, prefix="")
    return state.KeyInfo(key_id=api_key.pk, tenant_id=tenant.pk, tenant_name=tenant.name, cache_salt=None,
                         allowed_tier_ids=tenant_tier_ids(tenant), default_text_tier_id=tenant.default_text_tier_id,
                         default_image_tier_id=tenant.default_image_tier_id, rules=state._rules(api_key))


def dry_run(body: dict, *, task: str, api_key: ApiKey | None, tenant: Tenant) -> Outcome:
    """Where the gateway would send `body` from `api_key` (or a key of `tenant`'s)."""
    key = key_info(api_key=api_key, tenant=tenant)
    facts = Facts(body, {TASK_HEADER: task} if task else {}, max_image_bytes=settings.GATEWAY_MAX_BODY_BYTES)
    if needs_sizes(body["model"], key, facts):
        facts.size_pictures(sizing_limits())
    try:
        choice = tier_asked(body["model"], key, state._load_tiers(), bool(image_parts(body["messages"])), facts)
    except GatewayError as exc:
        return Outcome(refused=exc.message, auto=body["model"] == AUTO)
    rule = choice.rule
    second = choice.escalate_to if cascades(choice, body) else None  # a stream its rule does not cascade
    return Outcome(
        tier=choice.tier.name, sent=rule.send.describe(choice.tier.name) if rule else choice.tier.name,
        rule=rule.label if rule else "", auto=body["model"] == AUTO,
        escalate_to=rule.cascade.to.describe(second.name) if second else "",
        threshold=rule.cascade.threshold if second else None, confidence=rule.cascade.confidence if second else "",
        unpriced=tuple(tier.name for tier in (choice.tier, second) if tier is not None and not tier.priced))
