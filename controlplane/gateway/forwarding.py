"""Forwarding: the request written for the engine, and sent to an engine of its tier (an image
request to the first of them with a prefill slot free, prefill.py), to a second one when the
first cannot be reached or is found failing before it answered (never after it may have
started work)."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from django.conf import settings

from controlplane.gateway import ledger, prefill, routing, state, upstream
from controlplane.gateway.admission import Admission
from controlplane.gateway.apps import current_process
from controlplane.gateway.beside import answer_once_checks_pass, image_refusal, record_image_refusal
from controlplane.gateway.engine_watch import EngineFailing, unless_engine_fails
from controlplane.gateway.errors import GatewayError, NotAdmitted
from controlplane.gateway.prepare import Prepared, TierSpec
from controlplane.gateway.recording import aborted, hand_over_usage, ms_since, refusal_of
from controlplane.gateway.relaying import engine_failed_response, relay_answer, relay_stream
from controlplane.gateway.routing import Route
from controlplane.imaging.policy import DecodedDataURL

log = logging.getLogger(__name__)
# A tenant's body is read by orjson (body.py), bounded in shape first; the engine's is written
# by msgspec, which writes a data URL decoded as the body was read as it came, should one ever
# be sent on (prepare replaces every image it reads). The engine's answers are read by orjson.


def _as_written(value):
    if isinstance(value, DecodedDataURL):
        return str(value)
    raise NotImplementedError  # msgspec's TypeError


_write_json = msgspec.json.Encoder(enc_hook=_as_written).encode


# Lower runs first in vLLM: text ahead of images, images ahead of large images, so a large
# prefill does not hold up the text beside it.
PRIORITY_TEXT, PRIORITY_IMAGE, PRIORITY_LARGE_IMAGE = 0, 1, 2


def engine_body(key: state.KeyInfo, tier: TierSpec, prepared: Prepared, *, large: bool = False) -> dict:
    body = dict(prepared.body)
    body["model"] = tier.name
    if tier.priority_scheduling:
        body["priority"] = PRIORITY_LARGE_IMAGE if large else PRIORITY_IMAGE if prepared.images else PRIORITY_TEXT
    if key.cache_salt:
        body["cache_salt"] = key.cache_salt
    else:
        body.pop("cache_salt", None)
    if body.get("stream"):
        # Always ask for the usage chunk: without it a streamed request cannot be billed.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return body


async def forward(request_id: str, key: state.KeyInfo, tier: TierSpec, prepared: Prepared, admission: Admission,
                   started: float, route: Route):
    current_process().tier_names[tier.id] = tier.name
    record = admission.record
    large, images, candidates = route.large, route.images, route.candidates
    body = engine_body(key, tier, prepared, large=large)
    payload = _write_json(body)

    def payload_for(instance: state.InstanceSpec) -> bytes:
        # An external engine may serve its model under a name of its own.
        return _write_json({**body, "model": instance.model}) if instance.model else payload

    try:
        return await _try_engines(request_id, tier, prepared, admission, candidates, payload_for, started,
                                  large=large, images=images, first=route.first)
    except GatewayError as exc:
        # An image's 400 first, then the admission's refusal, as when they were awaited first.
        failed = await admission.failure()
        refused = await image_refusal(prepared)
        exc = refused or failed or exc
        if exc is failed:
            await hand_over_usage(exc.recorded_on(refusal_of(record), "admission"), started)
        else:
            await hand_over_usage(exc.recorded_on(record, "intake" if exc is refused else "engine"), started)
        return exc.response(request_id)
    except asyncio.CancelledError:
        if not record.recorded:  # gone while waiting for a slot: release the quota it reserved
            aborted(record, "routing", left="the client left while the request waited for an engine")
            await hand_over_usage(record, started)
        raise
    except Exception:
        if not record.recorded:  # whatever failed, the reservation is settled and the request metered
            record.failed("engine", 500, code="internal_error", message="the gateway failed on this request")
            await hand_over_usage(record, started)
        raise


async def _engine_for(request_id: str, tier: TierSpec, prepared: Prepared, tenant_id: int, ranked: list,
                      attempt: int, *, large: bool) -> tuple[state.InstanceSpec, prefill.Slot | None]:
    """The engine to send to: a text request's first choice; for an image request, the first
    of its engines to have a prefill slot, with the slot (a large image also takes one of the
    tier's large-image slots, unless it has an engine pool of its own)."""
    if not prepared.images:
        return ranked[0], None
    ask = prefill.Ask(tier_id=tier.id, tenant_id=tenant_id, holder=f"{request_id}:{attempt}",
                      engines=tuple(c.id for c in ranked), per_engine=tier.image_prefill_slots,
                      large=large and not routing.has_dedicated_large_pool(ranked),
                      large_slots=tier.large_image_concurrency, patience_ms=settings.GATEWAY_AFFINITY_PATIENCE_MS)
    slot = await current_process().prefill.take(ask, wait_s=settings.GATEWAY_PREFILL_WAIT_S)
    return next(c for c in ranked if c.id == slot.engine), slot


async def _try_engines(request_id, tier, prepared, admission, candidates, payload_for, started, *, large, images,
                       first=None):
    record = admission.record
    tried: set[int] = set()
    for attempt in range(2):  # a request that never reached an engine is retried once elsewhere
        ranked = current_process().engines.ranked(candidates, exclude=tried, large=large, images=images)
        if attempt == 0 and first is not None and first in ranked:  # the one journaled with its admission
            ranked = [first] + [c for c in ranked if c.id != first.id]
        if not ranked:
            break
        instance, slot = await _engine_for(request_id, tier, prepared, record.tenant_id, ranked, attempt, large=large)
        tried.add(instance.id)
        current_process().engines.outstanding[instance.id] += 1
        handed_over = False  # to the stream, which then owns the counter and the record
        try:
            if instance.id != record.instance_id:  # another than the one it was journaled with
                await ledger.engine_chosen(await admission.flight(), instance.id)
            if record.queue_ms is None:
                record.queue_ms = max(0, ms_since(started) - (record.prepare_ms or 0))
            sending = current_process().connections.engine_post(
                f"{instance.base_url}/v1/chat/completions", content=payload_for(instance),
                headers={"content-type": "application/json", "x-request-id": request_id,
                         **({"authorization": f"Bearer {instance.api_key}"} if instance.api_key else {})},
            )
            try:
                response = await unless_engine_fails(answer_once_checks_pass(sending, prepared, admission), tier.id,
                                                      instance.id)
            except NotAdmitted:
                raise
            except GatewayError as broken:  # an image sent unchecked failed its check: refused as before
                return await record_image_refusal(record, started, broken, request_id)
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
                return await engine_failed_response(record, started)
            if record.stream and response.status_code == 200:
                handed_over = True  # the slot too: given back with the stream's first token
                return relay_stream(request_id, tier, admission.answer.result(), prepared, response, instance, started,
                               slot)
            try:
                content = await response.read()
            except upstream.Broken as exc:
                log.warning("engine %s broke its answer to %s: %s", instance.id, request_id, exc)
                return await engine_failed_response(record, started)
            finally:
                await response.aclose()
            return await relay_answer(request_id, tier, record, prepared, response.status_code, content, started)
        except asyncio.CancelledError:
            # The client went away (or the server cut it) before the engine answered: the engine
            # still did work.
            aborted(record, "engine", left="the client left before the engine answered")
            await hand_over_usage(record, started)
            raise
        finally:
            if not handed_over:
                current_process().engines.outstanding[instance.id] -= 1
                if slot is not None:
                    await slot.release()
    if (failed := await admission.failure()) is not None:
        raise failed
    broken = await image_refusal(prepared)
    if broken is not None:
        return await record_image_refusal(record, started, broken, request_id)
    unavailable = GatewayError(503, f"no healthy engine is serving '{tier.name}' right now; retry shortly",
                               code="engine_unavailable", headers={"Retry-After": "5"})
    await hand_over_usage(unavailable.recorded_on(record, "routing"), started)
    return unavailable.response(request_id)
