"""The OpenAI-compatible front door: /v1/models and /v1/chat/completions, independent of the
web framework (see controlplane/gateway/asgi.py and views.py for the two ways in). A chat
request's path reads top to bottom in `_chat_completions` and `_serve`: authenticate, read,
choose the tier (by name, or by `auto`'s routing rules), prepare the images, route, admit,
forward and relay, record. A cascade (gateway/cascade.py) serves a request twice at most. A
request refused before a tier was chosen is recorded too, when its key is one of ours
(`refused`: gateway/refusals.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

from django.conf import settings

from controlplane.gateway import authentication, intake, moderation, state
from controlplane.gateway.admission import admit
from controlplane.gateway.apps import current_process
from controlplane.gateway.authentication import (
    NotAuthenticated,
    Refused,
    authenticate,
    declares_large_body,
)
from controlplane.gateway.beside import image_refusal
from controlplane.gateway.body import LARGE_BODY, TooComplex, read_body
from controlplane.gateway.cascade import Attempt, cascade, cascades
from controlplane.gateway.errors import GatewayError, error_response
from controlplane.gateway.forwarding import forward
from controlplane.gateway.http import Request, Response, json_response
from controlplane.gateway.prepare import TierSpec, prepare
from controlplane.gateway.recording import drain, hand_over_usage, in_background
from controlplane.gateway.routing import route_request
from controlplane.gateway.rules import Facts
from controlplane.gateway.state import read_or_unavailable
from controlplane.gateway.tier_choice import (
    AUTO,
    allowed_tiers,
    auto_tier,
    needs_sizes,
    sizing_limits,
    tier_asked,
)
from controlplane.gateway.validation import RequestInvalid, image_parts, validate_body
from controlplane.imaging.budget import MB, DecodeBudget, DecodeLimits, DecodersBusy
from controlplane.metering.records import UsageRecord

__all__ = ("chat_completions", "check_before_body", "drain", "models", "not_found")
log = logging.getLogger(__name__)


def decode_limits() -> DecodeLimits:
    """What decoding one request's pictures may cost, as the settings say."""
    return DecodeLimits(max_scans=settings.GATEWAY_IMAGE_MAX_SCANS, picture_cpu_s=settings.GATEWAY_IMAGE_CPU_MS / 1000,
                        request_cpu_s=settings.GATEWAY_REQUEST_IMAGE_CPU_MS / 1000,
                        picture_memory=settings.GATEWAY_IMAGE_DECODE_MB * MB,
                        request_memory=settings.GATEWAY_REQUEST_DECODE_MB * MB)


async def models(request: Request) -> Response:
    if request.method != "GET":
        return error_response(405, f"{request.method} is not allowed on /v1/models")
    try:
        key = await authenticate(request)
        allowed = allowed_tiers(key, await read_or_unavailable("the models", state.tiers()))
    except GatewayError as exc:
        return exc.response()
    auto = {"id": AUTO, "object": "model", "created": 0, "owned_by": "gateway", "resolves_to": {
        kind: getattr(auto_tier(key, allowed, has_images=kind == "images"), "name", None) for kind in ("text", "images")}}
    data = [auto]
    data += [
        {"id": t.name, "object": "model", "created": 0, "owned_by": "gateway",
         "modality": "text+image" if t.kind == "vision" else "text"}
        for t in sorted(allowed, key=lambda t: t.name)
    ]
    return json_response({"object": "list", "data": data})


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


async def check_before_body(headers: dict[str, str], *, chat: bool) -> Response | state.KeyInfo:
    """What is refused before a body is read (authentication.check_before_body), answered; a
    chat request's refusal recorded as `refused` says. Otherwise the caller's key."""
    arrived = time.monotonic()
    checked = await authentication.check_before_body(headers)
    if not isinstance(checked, Refused):
        return checked
    return await refused(new_request_id(), checked.error, checked.key if chat else None, arrived)


async def refused(request_id: str, error: GatewayError, key: state.KeyInfo | state.RefusedKey | None,
                  arrived: float, *, body: object = None, tier_id: int | None = None) -> Response:
    """The answer to a request refused before a tier served it (at authentication, or at its
    intake), recorded in its tenant's usage at no cost when its key is one of ours; a key that
    can no longer be used, up to refusals.RECORDED_PER_KEY_MINUTE a minute."""
    if _keeps_refusal(key):
        record = UsageRecord(request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id, tier_id=tier_id,
                             stream=isinstance(body, dict) and bool(body.get("stream")))
        await hand_over_usage(error.recorded_on(record, "intake"), arrived)
    return error.response(request_id)


def _keeps_refusal(key: state.KeyInfo | state.RefusedKey | None) -> bool:
    if key is None:  # no key of ours: no tenant to keep it for
        return False
    if isinstance(key, state.RefusedKey):  # no throttle of its own: a bound instead
        return current_process().recorded_refusals.take(key.key_id)
    return True  # a usable key's intake throttles its refusals with its requests


async def chat_completions(request: Request) -> Response:
    request_id = new_request_id()
    meters: list[intake.IntakeMeter] = []  # the request's, once its key is known
    status = 500
    try:
        response = await _chat_completions(request, request_id, meters)
        status = response.status
        return response
    except Exception:
        log.exception("gateway failure on %s", request_id)
        return error_response(500, "the gateway failed on this request; it has been logged",
                              code="internal_error", request_id=request_id)
    finally:
        if meters:  # a refusal is counted before it is answered; other requests' CPU, after
            if intake.refused(meters[0], status):
                await intake.charge(meters[0], status)
            else:
                in_background(intake.charge(meters[0], status))


async def _chat_completions(request: Request, request_id: str, meters: list):
    if request.method != "POST":
        return error_response(405, f"{request.method} is not allowed on /v1/chat/completions",
                              request_id=request_id)
    arrived = time.monotonic()
    key, body, unpriced = None, None, None
    try:
        key = await authenticate(request)
        meter = intake.IntakeMeter(key)
        meters.append(meter)
        raw = request.body
        if raw is None:
            raise GatewayError(413, f"request body exceeds {settings.GATEWAY_MAX_BODY_BYTES} bytes",
                               code="request_too_large")
        # A key past its intake's limits is refused before a large body is read: by the ASGI
        # front, which checked its key and counted the body, when the body's length was
        # declared; else here. What small bodies weigh is not worth a round trip to count.
        meter.checked = request.key is not None and declares_large_body(request.headers)
        if len(raw) >= LARGE_BODY and not meter.checked:
            meter.body_bytes = len(raw)
        if len(raw) >= LARGE_BODY:
            await intake.check(meter)
        with meter.timed():
            try:
                # On the event loop, a body of megabytes too: its parse holds the interpreter's
                # lock throughout, on a worker thread as here, and its base64 is decoded where it
                # lies; its shape is bounded before it is parsed.
                body = read_body(raw)
            except TooComplex as exc:
                raise GatewayError(400, str(exc), code="request_too_complex") from None
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise GatewayError(400, "the request body is not valid JSON", code="invalid_json") from None
            try:
                validate_body(body)
            except RequestInvalid as exc:
                raise GatewayError(400, str(exc), code=exc.code, param=exc.param) from None
        has_images = bool(image_parts(body["messages"]))
        if has_images:  # and before its pictures are opened
            await intake.check(meter)
        # What `auto`'s rules read of the request, only where there are rules to read.
        facts = Facts(body, request.headers, max_image_bytes=settings.GATEWAY_MAX_BODY_BYTES) \
            if body["model"] == AUTO and key.rules else None
        if facts is not None and needs_sizes(body["model"], key, facts):  # read from their headers, counted as the key's intake
            meter.cpu_s += await asyncio.to_thread(facts.size_pictures, sizing_limits())
        choice = tier_asked(body["model"], key, await read_or_unavailable("the models", state.tiers()), has_images,
                            facts)
        for tier in (choice.tier, choice.escalate_to if cascades(choice, body) else None):
            if tier is None:
                continue
            if not tier.priced:
                # Serving it would bill nothing, or bill later at a price nobody agreed to.
                log.error("tier %s has no price in effect; refusing its requests", tier.name)
                unpriced = tier.id
                raise GatewayError(503, f"the model '{tier.name}' has no price in effect yet; retry later",
                                   code="model_not_priced", headers={"Retry-After": "60"})
    except NotAuthenticated as exc:
        return await refused(request_id, exc, exc.key, arrived)
    except GatewayError as exc:
        return await refused(request_id, exc, key, arrived, body=body, tier_id=unpriced)
    started = time.monotonic()
    if cascades(choice, body):
        return await cascade(functools.partial(_serve, key=key, meter=meter, started=started), request_id, key,
                             choice, body, facts)
    return await _serve(request_id, choice.tier, body, Attempt(routed_by=choice.rule.label if choice.rule else ""),
                        key=key, meter=meter, started=started)


async def _serve(request_id: str, tier: TierSpec, body: dict, attempt: Attempt, *, key: state.KeyInfo,
                 meter: intake.IntakeMeter, started: float):
    """The request sent to `tier`: its images prepared, routed, admitted, forwarded, recorded."""
    prepared, stage = None, "intake"
    try:
        try:
            if tier.policy is not None:
                if meter.budget is not None:  # a cascade's second attempt: the first's pictures cost too
                    meter.cpu_s += meter.budget.cpu_spent
                meter.budget = DecodeBudget(decode_limits(), pixels=tier.policy.max_total_pixels,
                                            shared=current_process().decode_memory)
            prepared = await prepare(body, tier, max_image_bytes=settings.GATEWAY_MAX_BODY_BYTES,
                                     scope=str(key.tenant_id), repeats=current_process().prepared_images,
                                     budget=meter.budget, seen=current_process().seen)
            for again in prepared.pictures_again:
                current_process().counters.picture(tier=tier.name, again=again)
        except RequestInvalid as exc:
            raise GatewayError(400, str(exc), code=exc.code, param=exc.param) from None
        except DecodersBusy as exc:
            raise GatewayError(503, str(exc), code="service_unavailable", headers={"Retry-After": "1"}) from None
        if tier.require_moderation:
            try:
                await prepared.images_checked()  # the moderation service is sent only whole images
            except RequestInvalid as exc:
                raise GatewayError(400, str(exc), code=exc.code, param=exc.param) from None
            try:
                await moderation.moderate(body["messages"], [p.image.data_url() for p in prepared.images])
            except moderation.Flagged as flagged:
                raise GatewayError(400, str(flagged), code="content_policy_violation", param="messages") from None
            except moderation.Unavailable as unavailable:
                raise GatewayError(503, f"{unavailable}; retry shortly", code="moderation_unavailable",
                                   headers={"Retry-After": "5"}) from None
        stage = "routing"
        route = await route_request(key, tier, prepared)
        stage = "admission"
        admission = await admit(request_id, key, tier, prepared, started, engine=route.first,
                                also=attempt.reserve_also(prepared) if attempt.reserve_also else None,
                                marks=attempt)
        meter.admitted = True
        if key.capture:
            admission.record.capture = {"body": body, "prepared": prepared}  # made into what is kept later
    except GatewayError as exc:
        refused = await image_refusal(prepared)
        exc, stage = (refused, "intake") if refused else (exc, stage)
        # Refused once the tier was known: the tenant sees it in their usage, at no cost.
        await hand_over_usage(exc.recorded_on(attempt.mark(UsageRecord(
            request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id, tier_id=tier.id,
            stream=bool(body.get("stream")))), stage), started)
        return exc.response(request_id)
    except Exception:
        # A failure of the gateway itself: the request is in the tenant's usage all the same.
        await hand_over_usage(attempt.mark(UsageRecord(
            request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id, tier_id=tier.id,
            stream=bool(body.get("stream")))).failed(stage, 500, code="internal_error",
                                                     message="the gateway failed on this request"), started)
        raise
    return await forward(request_id, key, tier, prepared, admission, started, route)


async def not_found(request: Request, path: str = "") -> Response:
    return error_response(404, f"unknown endpoint /v1/{path}", code="unknown_url")
