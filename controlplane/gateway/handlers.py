"""The OpenAI-compatible front door: /v1/models and /v1/chat/completions, independent of the
web framework (see controlplane/gateway/asgi.py and views.py for the two ways in)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass

import msgspec
import orjson
from django.conf import settings
from django.utils import timezone

from controlplane.catalog.routing import resolve_auto
from controlplane.gateway import counters, intake, ledger, moderation, routing, state, upstream
from controlplane.gateway.body import LARGE_BODY, TooComplex, read_body
from controlplane.gateway.errors import GatewayError, error_response
from controlplane.gateway.http import Request, Response, json_response
from controlplane.gateway.ledger import Ask, Flight, Refused
from controlplane.gateway.prepare import (
    Prepared,
    RequestInvalid,
    TierSpec,
    image_parts,
    prepare,
    validate_body,
)
from controlplane.gateway.repeats import Repeats, Shared
from controlplane.imaging.budget import MB, DecodeBudget, DecodeLimits, DecodeMemory, DecodersBusy
from controlplane.imaging.policy import DecodedDataURL
from controlplane.imaging.tokens import engine_image_tokens
from controlplane.metering.services import UsageRecord
from controlplane.redis_clients import until_written

log = logging.getLogger(__name__)
AUTO = "auto"
# What pictures sent before became, for the requests that send them again.
repeats = Repeats(settings.GATEWAY_REPEATS_MB * 1024 * 1024, shared=Shared.from_settings())
# The memory this process's decodes may hold at once, whatever the requests bringing pictures.
decode_memory = DecodeMemory(settings.GATEWAY_DECODE_MEMORY_MB * MB, wait_s=settings.GATEWAY_DECODE_WAIT_MS / 1000,
                             decodes=settings.GATEWAY_DECODES_AT_ONCE)
# A tenant's body is read by orjson (body.py), bounded in shape first; the engine's is written
# by msgspec, which writes a data URL decoded as the body was read as it came, should one ever
# be sent on (prepare replaces every image it reads). The engine's answers are read by orjson.


def _as_written(value):
    if isinstance(value, DecodedDataURL):
        return str(value)
    raise NotImplementedError  # msgspec's TypeError


_write_json = msgspec.json.Encoder(enc_hook=_as_written).encode
_background: set[asyncio.Task] = set()
_tier_names: dict[int, str] = {}


def decode_limits() -> DecodeLimits:
    """What decoding one request's pictures may cost, as the settings say."""
    return DecodeLimits(max_scans=settings.GATEWAY_IMAGE_MAX_SCANS, picture_cpu_s=settings.GATEWAY_IMAGE_CPU_MS / 1000,
                        request_cpu_s=settings.GATEWAY_REQUEST_IMAGE_CPU_MS / 1000,
                        picture_memory=settings.GATEWAY_IMAGE_DECODE_MB * MB,
                        request_memory=settings.GATEWAY_REQUEST_DECODE_MB * MB)


async def _authenticate(request: Request) -> state.KeyInfo:
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    if request.key is not None:
        return request.key
    info = await _known("API keys", state.key_info(header[7:].strip()))
    if info is None:
        raise GatewayError(401, "incorrect, expired or revoked API key", code="invalid_api_key")
    return info


async def _known(what: str, fetching):
    """What the gateway reads from the database (through its caches), or a 503 when it can
    neither read it nor serve what it knew."""
    try:
        return await fetching
    except Exception:
        log.exception("%s cannot be read", what)
        raise GatewayError(503, f"{what} cannot be read right now; retry shortly", code="service_unavailable",
                           headers={"Retry-After": "5"}) from None


async def check_before_body(headers: dict[str, str]) -> Response | state.KeyInfo:
    """What is checked before the body is read: a body declared past the limit, a missing or
    unknown key, and a large body of a key past its intake's limits are refused (the response);
    otherwise the caller's key, to read the body for."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.GATEWAY_MAX_BODY_BYTES:
        return error_response(413, f"request body exceeds {settings.GATEWAY_MAX_BODY_BYTES} bytes",
                              code="request_too_large")
    try:
        key = await _authenticate(Request(method="POST", headers=headers, body=b""))
        if _declares_large_body(headers):
            await intake.check(intake.IntakeMeter(key), take_bytes=int(headers["content-length"]))
    except GatewayError as exc:
        return exc.response()
    return key


def _declares_large_body(headers: dict[str, str]) -> bool:
    declared = headers.get("content-length", "")
    return declared.isdigit() and int(declared) >= LARGE_BODY


def _allowed(key: state.KeyInfo, tiers: dict[str, TierSpec]) -> list[TierSpec]:
    return [t for t in tiers.values() if key.allowed_tier_ids is None or t.id in key.allowed_tier_ids]


async def models(request: Request) -> Response:
    if request.method != "GET":
        return error_response(405, f"{request.method} is not allowed on /v1/models")
    try:
        key = await _authenticate(request)
        allowed = _allowed(key, await _known("the models", state.tiers()))
    except GatewayError as exc:
        return exc.response()
    auto = {"id": AUTO, "object": "model", "created": 0, "owned_by": "gateway", "resolves_to": {
        kind: getattr(_auto(key, allowed, has_images=kind == "images"), "name", None) for kind in ("text", "images")}}
    data = [auto]
    data += [
        {"id": t.name, "object": "model", "created": 0, "owned_by": "gateway",
         "modality": "text+image" if t.kind == "vision" else "text"}
        for t in sorted(allowed, key=lambda t: t.name)
    ]
    return json_response({"object": "list", "data": data})


def _auto(key: state.KeyInfo, allowed: list[TierSpec], *, has_images: bool) -> TierSpec | None:
    return resolve_auto(allowed, has_images=has_images, tenant_text_tier_id=key.default_text_tier_id,
                        tenant_image_tier_id=key.default_image_tier_id)


def _pick_tier(model: str, key: state.KeyInfo, tiers: dict[str, TierSpec], has_images: bool) -> TierSpec:
    allowed = _allowed(key, tiers)
    if model == AUTO:
        tier = _auto(key, allowed, has_images=has_images)
        if tier is None:
            kind = "image" if has_images else "text"
            raise GatewayError(404, f"no default {kind} model is set for this key, so 'auto' means nothing: "
                               "ask for a model by name (GET /v1/models lists them)",
                               code="model_not_found", param="model")
        return tier
    tier = tiers.get(model)
    if tier is None:
        raise GatewayError(404, f"the model '{model}' does not exist", code="model_not_found",
                           param="model")
    if tier not in allowed:
        raise GatewayError(403, f"this API key may not use the model '{model}'",
                           code="model_not_allowed", param="model")
    return tier


async def chat_completions(request: Request) -> Response:
    request_id = f"req_{uuid.uuid4().hex}"
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
                _in_background(intake.charge(meters[0], status))


async def _chat_completions(request: Request, request_id: str, meters: list):
    if request.method != "POST":
        return error_response(405, f"{request.method} is not allowed on /v1/chat/completions",
                              request_id=request_id)
    try:
        key = await _authenticate(request)
        meter = intake.IntakeMeter(key)
        meters.append(meter)
        raw = request.body
        if raw is None:
            raise GatewayError(413, f"request body exceeds {settings.GATEWAY_MAX_BODY_BYTES} bytes",
                               code="request_too_large")
        # A key past its intake's limits is refused before a large body is read: by the ASGI
        # front, which checked its key and counted the body, when the body's length was
        # declared; else here. What small bodies weigh is not worth a round trip to count.
        meter.checked = request.key is not None and _declares_large_body(request.headers)
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
        tier = _pick_tier(body["model"], key, await _known("the models", state.tiers()), has_images)
        if not tier.priced:
            # Serving it would bill nothing, or bill later at a price nobody agreed to.
            log.error("tier %s has no price in effect; refusing its requests", tier.name)
            raise GatewayError(503, f"the model '{tier.name}' has no price in effect yet; retry later",
                               code="model_not_priced", headers={"Retry-After": "60"})
    except GatewayError as exc:
        return exc.response(request_id)
    started, prepared = time.monotonic(), None
    try:
        try:
            if tier.policy is not None:
                meter.budget = DecodeBudget(decode_limits(), pixels=tier.policy.max_total_pixels,
                                            shared=decode_memory)
            prepared = await prepare(body, tier, max_image_bytes=settings.GATEWAY_MAX_BODY_BYTES,
                                     scope=str(key.tenant_id), repeats=repeats, budget=meter.budget)
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
        route = await _route(key, tier, prepared)
        admission = await _admit(request_id, key, tier, prepared, started, engine=route.first)
        meter.admitted = True
    except GatewayError as exc:
        exc = await _broken_image(prepared) or exc
        # Refused once the tier was known: the tenant sees it in their usage, at no cost.
        await _record(UsageRecord(request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id,
                                  tier_id=tier.id, status="error", http_status=exc.status,
                                  stream=bool(body.get("stream"))), started)
        return exc.response(request_id)
    except Exception:
        # A failure of the gateway itself: the request is in the tenant's usage all the same.
        await _record(UsageRecord(request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id,
                                  tier_id=tier.id, status="error", http_status=500,
                                  stream=bool(body.get("stream"))), started)
        raise
    return await _forward(request_id, key, tier, prepared, admission, started, route)


@dataclass(frozen=True)
class _Route:
    candidates: list
    large: bool
    images: tuple[str, ...]  # the keys of its images' bytes, by which engines are preferred
    # The engine chosen before admission, journaled with it: one round trip to the ledger
    # fewer. None when a large image must wait for its turn first (chosen after the wait).
    first: object = None


async def _route(key: state.KeyInfo, tier: TierSpec, prepared: Prepared) -> _Route:
    candidates = await _known("the engines", state.instances(tier.id))
    large = prepared.image_tokens > tier.large_image_threshold
    # Per tenant: one tenant's requests never steer toward the engine holding another's images.
    images = tuple(f"{key.tenant_id}:{p.key}" for p in prepared.images)
    waits = large and not routing.has_dedicated_large_pool(candidates)
    first = None if waits else routing.choose(candidates, large=large, images=images)
    return _Route(candidates, large, images, first)


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


class _NotAdmitted(GatewayError):
    """A request's admission failed: its tenant's quota refused it (429), or the quota's store
    did not answer (503; it may have made the reservation all the same, which the request's
    record then settles as it was made)."""

    @property
    def refused(self) -> bool:
        return self.status == 429


class _Beside:
    """Whether a request's admission may run beside its trip to the engine rather than before it.

    Beside, the engine is sent the request as soon as the script that admits and journals it
    is on its way to Redis (in the kernel's buffer: it gets there even if this process dies
    now, so the request is journaled as it would have been), and the engine's answer is
    relayed only once Redis has admitted it; refused, the exchange is abandoned (the engine
    drops a request whose connection closes) and the client gets the 429 it would have got.
    One round trip to Redis off every request's path. Only where the admission is likely to
    pass, as the engine's work on a request refused is thrown away: not for a tenant whose
    last admission in this process was refused (until one passes again), not while the store
    has not answered this process's last admission (each would wait out its timeout and get a
    503), and not for a large image (the limit on those at once is the one meant to be met,
    their prefill the costliest to throw away, and one waiting for its turn has no engine
    yet). A burst beyond a limit still reaches the engine up to the first refusal, each
    abandoned within a round trip to Redis. The database's ledger answers once its
    transaction commits: its admissions are awaited.

    One window is left: a request whose admission does not journal it at its first script (the
    period's counters to start, or Redis lost its scripts: a second script follows, tens of
    milliseconds later at most) is with the engine meanwhile, and were the gateway to die
    then, the engine's work on it would be billed to nobody (its client got nothing)."""

    def __init__(self):
        self.refused: set[int] = set()  # tenants
        self.store_silent = False

    def likely(self, tenant_id: int) -> bool:
        return not self.store_silent and tenant_id not in self.refused

    def answered(self, tenant_id: int, *, admitted: bool) -> None:
        self.store_silent = False
        if admitted:
            self.refused.discard(tenant_id)
        else:
            self.refused.add(tenant_id)

    def unanswered(self) -> None:
        self.store_silent = True


_beside = _Beside()


@dataclass(frozen=True)
class _Admission:
    """A request's admission: answered before the request was forwarded, or running beside its
    trip to the engine (see _Beside)."""

    record: UsageRecord
    answer: asyncio.Future  # the request's Flight once admitted; a _NotAdmitted if not

    async def flight(self) -> Flight:
        """The request's flight once admitted (_NotAdmitted if not). A caller giving up does
        not stop the admission."""
        return await asyncio.shield(self.answer)

    async def failure(self) -> _NotAdmitted | None:
        """Once answered: why it was not admitted, or None."""
        try:
            await asyncio.shield(self.answer)
        except _NotAdmitted as failed:
            return failed
        return None


async def _admit(request_id: str, key: state.KeyInfo, tier: TierSpec, prepared: Prepared,
                 started: float, *, engine=None) -> _Admission:
    """Reserve the request against the tenant's quota and journal it, in one step; or refuse
    it with a 429. With its engine chosen and its admission likely to pass, the admission runs
    beside the request's trip to that engine (see _Beside): returned once it is on its way to
    the ledger's store, answered while the engine works."""
    record = UsageRecord(
        request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id, tier_id=tier.id,
        stream=bool(prepared.body.get("stream")), images=[(p.image, p.tokens, 0) for p in prepared.images],
        image_tokens=prepared.image_tokens, text_tokens=prepared.text_tokens,
        counted_prompt_tokens=prepared.text_tokens + prepared.image_tokens, prompt_estimated=prepared.estimated,
        prepare_ms=_ms_since(started),  # the images are ready (and moderated) when admission starts
        instance_id=engine.id if engine is not None else None,
        checking=prepared.checking,
    )
    ask = None if key.limits is None else Ask(
        image_tokens=prepared.image_tokens,
        total_tokens=prepared.text_tokens + prepared.image_tokens + prepared.body["max_tokens"],
        large=prepared.image_tokens > tier.large_image_threshold)
    key_counted_at = None
    if key.key_requests_per_minute is not None:
        key_counted_at = timezone.now()
        try:
            counted = await ledger.key_rate(key.key_id, key.key_requests_per_minute, key_counted_at)
        except Exception:
            log.exception("could not check the rate of key %s for %s", key.key_id, request_id)
            raise _quota_unavailable() from None
        if not counted:
            retry = 60 - timezone.now().second
            raise GatewayError(429, f"this API key's limit exceeded: {key.key_requests_per_minute:,} requests "
                               f"per minute; retry after {retry}s", code="rate_limit_exceeded",
                               headers={"Retry-After": str(retry)})
    written = asyncio.get_running_loop().create_future() \
        if engine is not None and not (ask is not None and ask.large) and _beside.likely(key.tenant_id) else None
    answer = asyncio.ensure_future(_admission(record, key, ask, key_counted_at, written))
    answer.add_done_callback(lambda done: done.cancelled() or done.exception())  # whoever looks, or none
    try:
        if written is not None:
            await until_written(answer, written)
        else:
            await asyncio.shield(answer)
    except asyncio.CancelledError:
        # A request admitted just as the client leaves must still be released.
        answer.add_done_callback(lambda done: _release_if_admitted(done, record, started))
        raise
    if answer.done():
        answer.result()  # its refusal, before anything is sent
        return _Admission(record, answer)
    record.admission = _Admission(record, answer)
    return record.admission


async def _admission(record: UsageRecord, key: state.KeyInfo, ask: Ask | None, key_counted_at,
                     written: asyncio.Future | None) -> Flight:
    try:
        flight = await ledger.admit(record, key.limits, ask, written)
    except Refused as refused:
        _beside.answered(key.tenant_id, admitted=False)
        if key_counted_at is not None:
            await ledger.key_rate_return(key.key_id, key_counted_at)
        code = "rate_limit_exceeded" if refused.limit in ("requests_per_minute", "concurrent_large_images") \
            else "insufficient_quota"
        raise _NotAdmitted(429, str(refused), code=code, headers={"Retry-After": str(refused.retry_after)}) from None
    except Exception:
        # The quota cannot be checked (its store does not answer): nothing is answered unchecked.
        _beside.unanswered()
        log.exception("could not admit %s against its quota", record.request_id)
        raise _quota_unavailable() from None
    if flight.answered:
        _beside.answered(key.tenant_id, admitted=True)
    else:  # a request without a quota goes on without its journal: not an answer
        _beside.unanswered()
    return flight


def _quota_unavailable() -> _NotAdmitted:
    return _NotAdmitted(503, "the quota service is unavailable; retry shortly", code="quota_unavailable",
                        headers={"Retry-After": "5"})


def _refusal_of(record: UsageRecord, status: int) -> UsageRecord:
    """What a request its admission did not admit is recorded as, as any refused before an
    engine worked on it: in the tenant's usage, at no cost."""
    return UsageRecord(request_id=record.request_id, tenant_id=record.tenant_id, api_key_id=record.api_key_id,
                       tier_id=record.tier_id, status="error", http_status=status, stream=record.stream,
                       latency_ms=record.latency_ms)


def _release_if_admitted(done: asyncio.Future, record: UsageRecord, started: float) -> None:
    """The client left while its request was admitted: recorded at no cost, quota released.
    So too when the admission's reply was lost (its store may have made it all the same):
    the record settles it as it was made, as a 503's would have."""
    if done.cancelled() or (isinstance(done.exception(), _NotAdmitted) and done.exception().refused):
        return  # nothing was reserved
    # No engine was sent it: the one chosen beforehand did no work, nothing is billed.
    record.status, record.http_status, record.instance_id = "aborted", 499, None
    _in_background(_record(record, started))


def _upstream_body(key: state.KeyInfo, tier: TierSpec, prepared: Prepared, *, large: bool = False) -> dict:
    body = dict(prepared.body)
    body["model"] = tier.name
    if tier.priority_scheduling:
        # Lower runs first in vLLM: text ahead of images, images ahead of large images, so
        # a large prefill does not hold up the text beside it.
        body["priority"] = 2 if large else 1 if prepared.images else 0
    if key.cache_salt:
        body["cache_salt"] = key.cache_salt
    else:
        body.pop("cache_salt", None)
    if body.get("stream"):
        # Always ask for the usage chunk: without it a streamed request cannot be billed.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return body


async def _forward(request_id: str, key: state.KeyInfo, tier: TierSpec, prepared: Prepared, admission: _Admission,
                   started: float, route: _Route):
    _tier_names[tier.id] = tier.name
    record = admission.record
    large, images, candidates = route.large, route.images, route.candidates
    body = _upstream_body(key, tier, prepared, large=large)
    payload = _write_json(body)
    slot = None
    try:
        if large and not routing.has_dedicated_large_pool(candidates):
            # No isolated pool: large requests take turns, so they never fill every batch.
            slot = _Slot(routing.large_slots(tier.id, tier.large_image_concurrency))
            try:
                await slot.acquire(key.tenant_id, timeout=settings.GATEWAY_LARGE_IMAGE_WAIT_S)
            except TimeoutError:
                raise GatewayError(429, f"too many large-image requests on '{tier.name}' at once; retry shortly",
                                   code="rate_limit_exceeded", headers={"Retry-After": "2"}) from None
        return await _attempts(request_id, tier, prepared, admission, candidates, payload, started,
                               large=large, images=images, slot=slot, first=route.first)
    except GatewayError as exc:
        # An image's 400 first, then the admission's refusal, as when they were awaited first.
        failed = await admission.failure()
        exc = await _broken_image(prepared) or failed or exc
        if exc is failed:
            await _record(_refusal_of(record, exc.status), started)
        else:
            record.status, record.http_status = "error", exc.status
            await _record(record, started)
        return exc.response(request_id)
    except asyncio.CancelledError:
        if not record.recorded:  # gone while waiting for a slot: release the quota it reserved
            record.status, record.http_status = "aborted", 499
            await _record(record, started)
        raise
    except Exception:
        if not record.recorded:  # whatever failed, the reservation is settled and the request metered
            record.status, record.http_status = "error", 500
            await _record(record, started)
        raise
    finally:
        if slot is not None and not slot.handed_over:
            slot.release()


class _Slot:
    def __init__(self, slots: routing.FairSlots):
        self.slots, self.held, self.handed_over = slots, False, False

    async def acquire(self, tenant_id: int, *, timeout: float):
        await self.slots.acquire(tenant_id, timeout=timeout)
        self.held = True

    def release(self):
        if self.held:
            self.held = False
            self.slots.release()


async def _attempts(request_id, tier, prepared, admission, candidates, payload, started, *, large, images, slot,
                    first=None):
    record = admission.record
    tried: set[int] = set()
    for attempt in range(2):  # a request that never reached an engine is retried once elsewhere
        instance = first if attempt == 0 and first is not None else routing.choose(
            candidates, exclude=tried, large=large, images=images)
        if instance is None:
            break
        tried.add(instance.id)
        routing.outstanding[instance.id] += 1
        handed_over = False  # to the stream, which then owns the counter and the record
        try:
            if instance.id != record.instance_id:  # another than the one it was journaled with
                await ledger.engine_chosen(await admission.flight(), instance.id)
            if record.queue_ms is None:
                record.queue_ms = max(0, _ms_since(started) - (record.prepare_ms or 0))
            sending = upstream.engine_post(
                f"{instance.base_url}/v1/chat/completions", content=payload,
                headers={"content-type": "application/json", "x-request-id": request_id,
                         **({"authorization": f"Bearer {instance.api_key}"} if instance.api_key else {})},
            )
            try:
                response = await _unless_engine_fails(_once_passed(sending, prepared, admission), tier.id,
                                                      instance.id)
            except _NotAdmitted:
                raise
            except GatewayError as broken:  # an image sent unchecked failed its check: refused as before
                return await _refused_image(record, started, broken.response(request_id))
            except EngineFailing:
                # Hung or dead (supervision says so): it will not answer; another engine may.
                log.warning("engine %s stopped answering %s; trying another", instance.id, request_id)
                continue
            except upstream.Unreachable as exc:
                log.warning("engine %s unreachable for %s: %s", instance.id, request_id, exc)
                continue
            except upstream.Broken as exc:
                # The engine may have started work: do not run the request a second time.
                log.warning("engine %s failed %s mid-request: %s", instance.id, request_id, exc)
                return await _engine_failed(record, started)
            if response.status_code == 200:
                routing.remember(images, instance.id)
            if record.stream and response.status_code == 200:
                handed_over = True
                if slot is not None:
                    slot.handed_over = True
                return _stream(request_id, tier, admission.answer.result(), prepared, response, instance, started,
                               slot)
            try:
                content = await response.read()
            except upstream.Broken as exc:
                log.warning("engine %s broke its answer to %s: %s", instance.id, request_id, exc)
                return await _engine_failed(record, started)
            finally:
                await response.aclose()
            return await _finish_plain(request_id, tier, record, prepared, response.status_code, content, started)
        except asyncio.CancelledError:
            # The client went away before the engine answered: the engine still did work.
            record.status, record.http_status = "aborted", 499
            await _record(record, started)
            raise
        finally:
            if not handed_over:
                routing.outstanding[instance.id] -= 1
    if (failed := await admission.failure()) is not None:
        raise failed
    broken = await _broken_image(prepared)
    if broken is not None:
        return await _refused_image(record, started, broken.response(request_id))
    record.status, record.http_status = "error", 503
    await _record(record, started)
    return error_response(503, f"no healthy engine is serving '{tier.name}' right now; retry shortly",
                          code="engine_unavailable", request_id=request_id,
                          headers={"Retry-After": "5"})


async def _broken_image(prepared: Prepared | None) -> GatewayError | None:
    """The 400 of an image sent unchecked that failed its check, once its check is done: what
    a request refused for any other reason is answered with all the same, as it would have been
    had its images been checked before anything else."""
    if prepared is None or prepared.checking is None:
        return None
    try:
        await prepared.images_checked()
    except RequestInvalid as exc:
        return GatewayError(400, str(exc), code=exc.code, param=exc.param)
    return None


async def _refused_image(record: UsageRecord, started: float, response: Response) -> Response:
    record.status, record.http_status = "error", 400
    await _record(record, started)
    return response


async def _once_passed(sending, prepared: Prepared, admission: _Admission):
    """The engine's answer to `sending`, once what ran beside the engine's work has passed: the
    checks of images sent as they came, and the request's admission (each takes milliseconds
    at most, where the engine takes tens of them at least). Nothing is answered before. One
    that fails abandons the exchange (the engine drops a request whose connection closes) and
    raises its error as it would have been raised had it been awaited first: an image's 400
    (GatewayError), else the admission's 429 or 503 (_NotAdmitted)."""
    checking = prepared.checking
    if checking is not None and not checking.done():  # an image sent as it came, its check running
        answer = asyncio.ensure_future(sending)
        try:
            broken = await _broken_image(prepared)
            failed = await admission.failure()  # awaited either way: nothing is recorded before it
            if broken or failed:
                raise broken or failed
        except BaseException:
            answer.cancel()
            response = await asyncio.gather(answer, return_exceptions=True)
            if response and not isinstance(response[0], BaseException):
                await response[0].aclose()
            raise
        return await answer
    if (broken := await _broken_image(prepared)) is not None:
        sending.close()  # never started
        await admission.failure()  # nothing is recorded before it has its answer
        raise broken
    if admission.answer.done():
        if (failed := await admission.failure()) is not None:
            sending.close()
            raise failed
        return await sending
    try:
        response = await _unless_not_admitted(sending, admission)
    except Exception:
        # The engine failed first (unreachable, or broken): what that means waits for the
        # admission, which a refusal takes precedence over.
        if (failed := await admission.failure()) is not None:
            raise failed from None
        raise
    try:
        failed = await admission.failure()  # the engine's headers came first
    except BaseException:  # the client left, or the engine's watch failed it over, meanwhile
        await response.aclose()
        raise
    if failed is not None:
        await response.aclose()
        raise failed
    return response


async def _unless_not_admitted(sending, admission: _Admission):
    """`sending`'s result, or the admission's failure (_NotAdmitted) as soon as it has one, the
    exchange abandoned: the admission's answer cancels the wait, rather than the engine's
    answer being waited for in a task of its own (a task a request costs more CPU than the rest
    of this)."""
    task, waiting, refused = asyncio.current_task(), [True], []

    def answered(done: asyncio.Future) -> None:
        # Run soon after the answer, perhaps after the wait ended: then it must not cancel.
        if waiting[0] and not done.cancelled() and done.exception() is not None:
            refused.append(True)
            task.cancel()

    admission.answer.add_done_callback(answered)
    try:
        return await sending
    except asyncio.CancelledError:
        if refused and task.uncancel() == 0:  # only the admission cancelled it, not the client leaving
            raise await admission.failure() from None
        raise
    finally:
        waiting[0] = False
        admission.answer.remove_done_callback(answered)


async def _engine_failed(record: UsageRecord, started: float) -> Response:
    record.status, record.http_status = "error", 502
    await _record(record, started)
    return error_response(502, "the engine failed while answering; retry the request",
                          code="engine_error", request_id=record.request_id)


def _usage_details(usage: dict, prepared: Prepared) -> dict:
    """The usage a client sees. `image_tokens` is the gateway's count: every prompt position
    the images take (features and the markers around each image), what they are billed for.
    vLLM's own `multimodal_tokens` (the placeholders alone) is passed through beside it."""
    details = dict(usage.get("prompt_tokens_details") or {})
    details.setdefault("cached_tokens", 0)
    details["image_tokens"] = prepared.image_tokens
    return {**usage, "prompt_tokens_details": details}


def _engine_image_tokens(usage: dict) -> int | None:
    """The engine's own count of image placeholders: vLLM's `multimodal_tokens.image`, or
    SGLang's `image_tokens` (the span of its image items, the same placeholders)."""
    details = usage.get("prompt_tokens_details") or {}
    counts = details.get("multimodal_tokens")
    value = counts.get("image") if isinstance(counts, dict) else details.get("image_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _apply_usage(record: UsageRecord, usage: dict | None, prepared: Prepared, family: str) -> None:
    if not usage:
        return
    prompt = int(usage.get("prompt_tokens") or 0)
    record.text_tokens = max(0, prompt - record.image_tokens) if prompt else record.text_tokens
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    # The engine reports one number of cached prompt tokens: the prefix it reused, in whole
    # KV blocks. Each image's cached share is the part of its positions inside that prefix.
    record.images = [(p.image, p.tokens, max(0, min(p.tokens, record.cached_tokens - p.position)))
                     for p in prepared.images]
    record.cached_image_tokens = sum(cached for _, _, cached in record.images)
    record.engine_image_tokens = _engine_image_tokens(usage)
    expected = [engine_image_tokens(family, p.tokens) for p in prepared.images]
    if prepared.images and None not in expected:
        # An engine that reports no image count for a request with images disagrees as well.
        record.image_tokens_disagree = record.engine_image_tokens != sum(expected)
        if record.image_tokens_disagree:
            log.warning("engine counted %s image tokens for %s where the gateway expects %s",
                        record.engine_image_tokens, record.request_id, sum(expected))


async def _finish_plain(request_id, tier, record, prepared, status, content, started):
    try:
        data = orjson.loads(content)
    except ValueError:
        data = None
    if status != 200 or not isinstance(data, dict):
        record.status, record.http_status = "error", 502 if status < 400 else status
        await _record(record, started)
        message = "the engine returned an invalid response"
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            message = f"the engine refused the request: {data['error'].get('message', '')}"
        http = status if 400 <= status < 500 else 502
        return error_response(http, message, code="upstream_error", request_id=request_id)
    _apply_usage(record, data.get("usage"), prepared, tier.family)
    if data.get("usage"):
        data["usage"] = _usage_details(data["usage"], prepared)
    data["id"] = data.get("id") or request_id
    await _record(record, started)
    return json_response(data, headers={"x-request-id": request_id})


def _stream(request_id, tier, flight, prepared, response, instance, started, slot=None):
    record = flight.record
    client_wants_usage = bool((prepared.body.get("stream_options") or {}).get("include_usage"))
    progress = {"finished": False, "closed": False}

    async def close():
        """Once, however the stream ends: finished, failed, client gone, or never read at all."""
        if progress["closed"]:
            return
        progress["closed"] = True
        try:
            await response.aclose()
        finally:
            routing.outstanding[instance.id] -= 1
            if slot is not None:
                slot.release()
            if not progress["finished"] and record.status == "ok":
                record.status = "aborted"
            if not record.output_tokens:
                record.output_tokens = flight.produced  # what was generated before the end
            await _record(record, started)  # its hand-over survives this task being cancelled

    async def events():
        lines = _watched_lines(response, tier.id, instance.id)
        try:
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    progress["finished"] = True
                    yield b"data: [DONE]\n\n"
                    continue
                try:
                    chunk = orjson.loads(data)
                except ValueError:
                    continue
                if chunk.get("usage"):
                    _apply_usage(record, chunk["usage"], prepared, tier.family)
                    chunk["usage"] = _usage_details(chunk["usage"], prepared)
                    if not chunk.get("choices") and not client_wants_usage:
                        continue
                    if not client_wants_usage:
                        chunk.pop("usage")
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        flight.produced += 1  # also what the journal bills if this gateway dies
                        if record.ttft_ms is None:
                            record.ttft_ms = _ms_since(started)
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except (upstream.Broken, EngineFailing) as exc:
            # The engine dropped the stream, or hung: tell the client in the stream's own terms.
            log.warning("engine %s broke the stream of %s: %s", instance.id, request_id, exc)
            record.status, record.http_status = "error", 502
            error = {"error": {"message": "the engine failed while streaming; retry the request",
                               "type": "server_error", "param": None, "code": "engine_error"}}
            yield b"data: " + orjson.dumps(error) + b"\n\n"
        finally:
            await lines.aclose()
            await close()

    return Response(stream=events(), content_type="text/event-stream", on_close=close,
                    headers={"cache-control": "no-cache", "x-request-id": request_id})


class EngineFailing(Exception):
    """Supervision found the engine a request waits on hung or dead."""


class _EngineWatch:
    """One per event loop: every GATEWAY_ENGINE_WATCH_S, the engines that requests wait on are
    looked up among their tiers' failing ones, and the requests waiting on those are told.
    One task for every request in flight, not one per request."""

    def __init__(self):
        self.waits: dict[object, tuple[int, int, object]] = {}  # token -> (tier, instance, callback)
        self.task: asyncio.Task | None = None

    def add(self, tier_id: int, instance_id: int, callback) -> object:
        token = object()
        self.waits[token] = (tier_id, instance_id, callback)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        return token

    def remove(self, token) -> None:
        self.waits.pop(token, None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(settings.GATEWAY_ENGINE_WATCH_S)
            for tier_id in {tier for tier, _, _ in self.waits.values()}:
                try:
                    failing = await state.failing(tier_id)
                except Exception:  # the database does not answer: no news, keep waiting
                    log.warning("could not check the engines of tier %s", tier_id)
                    continue
                for token, (tier, instance_id, callback) in list(self.waits.items()):
                    if tier == tier_id and instance_id in failing:
                        self.waits.pop(token, None)
                        callback()


_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _EngineWatch


def _watch() -> _EngineWatch:
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = _EngineWatch()
    return watch


async def _unless_engine_fails(awaitable, tier_id: int, instance_id: int):
    """`awaitable`'s result, or EngineFailing once its engine is found hung or dead (what
    would otherwise wait for the upstream timeout, minutes)."""
    task, failed = asyncio.current_task(), []

    def engine_failed():
        failed.append(True)
        task.cancel()

    token = _watch().add(tier_id, instance_id, engine_failed)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if failed and task.uncancel() == 0:  # only the watch cancelled it, not the client leaving
            raise EngineFailing(instance_id) from None
        raise
    finally:
        _watch().remove(token)


_END = object()


async def _watched_lines(response, tier_id: int, instance_id: int):
    """The lines of a streamed answer, read by a task of their own, ending in EngineFailing
    if the engine is found hung or dead meanwhile."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for line in response.lines():
                queue.put_nowait(line)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)

    pumping = asyncio.ensure_future(pump())
    token = _watch().add(tier_id, instance_id, lambda: queue.put_nowait(EngineFailing(instance_id)))
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        _watch().remove(token)
        pumping.cancel()


async def drain() -> None:
    """Wait for the work left of answered requests: hand-overs awaiting Redis's reply, and
    what a failed one calls for (each bounded by its store's timeouts). Before the process exits."""
    while _background:
        await asyncio.gather(*_background, return_exceptions=True)


def _in_background(coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def _record(record: UsageRecord, started: float) -> None:
    """Hand the request's usage over. One whose admission ran beside the engine is handed over
    once its admission has its answer (its finish must never reach the ledger before its
    admission does); not admitted, a request its client left is recorded as its refusal."""
    if record.recorded:
        return
    record.recorded = True
    record.latency_ms = _ms_since(started)
    # The answer waits until the usage is on its way to Redis (written to its connection: it
    # gets there even if this process dies now), not for Redis's acknowledgement, which the
    # hand-over awaits afterwards, with what a failed one calls for: one round trip fewer on
    # every answer. A hand-over that never writes to Redis (the database's ledger, a Redis that
    # cannot be reached) is waited for to its end. The hand-over runs in a task of its own, which
    # a client leaving (cancelling this one) cannot interrupt halfway.
    written = asyncio.get_running_loop().create_future()
    await until_written(_in_background(_hand_over(record, written)), written)


async def _hand_over(record: UsageRecord, written: asyncio.Future | None = None) -> None:
    if record.admission is not None and (failed := await record.admission.failure()) is not None \
            and record.status == "aborted":
        record = _refusal_of(record, failed.status)
        record.recorded = True
    counters.count(tier=_tier_names.get(record.tier_id, str(record.tier_id)), status=record.status,
                   images=record.image_tokens, disagree=record.image_tokens_disagree)
    if record.checking is not None:
        # Its images sent as they came get their fingerprints once checked (a refused one keeps
        # its empty one: the record is its 400's).
        try:
            checked = await record.checking
        except Exception:  # noqa: BLE001 - the request was answered with what it was
            checked = None
        if checked is not None:
            record.images = [(p.image, tokens, cached) for p, (_, tokens, cached) in
                             zip(checked, record.images, strict=True)]
    try:
        # The usage handed over and the reservation corrected to what was really used, at once.
        await ledger.finish(record, written)
    except Exception:  # never lose the response over metering; the error is logged loudly
        log.exception("could not record usage for %s", record.request_id)


async def not_found(request: Request, path: str = "") -> Response:
    return error_response(404, f"unknown endpoint /v1/{path}", code="unknown_url")
