"""Relaying the engine's answer to the client, whole or streamed, with the usage the client
sees and the usage the request is billed for taken from it."""

from __future__ import annotations

import logging

import orjson

from controlplane.gateway import upstream
from controlplane.gateway.apps import current_process
from controlplane.gateway.engine_watch import EngineFailing, watched_lines
from controlplane.gateway.errors import error_response
from controlplane.gateway.http import Response, json_response
from controlplane.gateway.prepare import Prepared
from controlplane.gateway.recording import RESTARTING, aborted, hand_over_usage, ms_since
from controlplane.gateway.stopping import STREAMS_ENDING
from controlplane.imaging.tokens import engine_image_tokens
from controlplane.metering.records import UsageRecord

log = logging.getLogger(__name__)


async def engine_failed_response(record: UsageRecord, started: float) -> Response:
    message = "the engine failed while answering; retry the request"
    await hand_over_usage(record.failed("engine", 502, code="engine_error", message=message), started)
    return error_response(502, message, code="engine_error", request_id=record.request_id)


def client_usage(usage: dict, prepared: Prepared) -> dict:
    """The usage a client sees. `image_tokens` is the gateway's count: every prompt position
    the images take (features and the markers around each image), what they are billed for.
    vLLM's own `multimodal_tokens` (the placeholders alone) is passed through beside it."""
    details = dict(usage.get("prompt_tokens_details") or {})
    details.setdefault("cached_tokens", 0)
    details["image_tokens"] = prepared.image_tokens
    return {**usage, "prompt_tokens_details": details}


def engine_image_count(usage: dict) -> int | None:
    """The engine's own count of image placeholders: vLLM's `multimodal_tokens.image`, or
    SGLang's `image_tokens` (the span of its image items, the same placeholders)."""
    details = usage.get("prompt_tokens_details") or {}
    counts = details.get("multimodal_tokens")
    value = counts.get("image") if isinstance(counts, dict) else details.get("image_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def apply_engine_usage(record: UsageRecord, usage: dict | None, prepared: Prepared, family: str) -> None:
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
    record.engine_image_tokens = engine_image_count(usage)
    expected = [engine_image_tokens(family, p.tokens) for p in prepared.images]
    if prepared.images and None not in expected:
        # An engine that reports no image count for a request with images disagrees as well.
        record.image_tokens_disagree = record.engine_image_tokens != sum(expected)
        if record.image_tokens_disagree:
            log.warning("engine counted %s image tokens for %s where the gateway expects %s",
                        record.engine_image_tokens, record.request_id, sum(expected))


async def relay_answer(request_id, tier, record, prepared, status, content, started):
    try:
        data = orjson.loads(content)
    except ValueError:
        data = None
    if status != 200 or not isinstance(data, dict):
        message = "the engine returned an invalid response"
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            message = f"the engine refused the request: {data['error'].get('message', '')}"
        record.failed("engine", 502 if status < 400 else status, code="upstream_error",
                      message=f"{message} (HTTP {status})")
        await hand_over_usage(record, started)
        http = status if 400 <= status < 500 else 502
        return error_response(http, message, code="upstream_error", request_id=request_id)
    apply_engine_usage(record, data.get("usage"), prepared, tier.family)
    if record.judge is not None:
        record.judge(record, data)
    data["model"] = tier.name  # what the client asked for, whatever name the engine serves it under
    if data.get("usage"):
        data["usage"] = client_usage(data["usage"], prepared)
    data["id"] = data.get("id") or request_id
    if record.capture is not None:
        record.capture["response"] = orjson.dumps(data).decode()
    await hand_over_usage(record, started)
    return json_response(data, headers={"x-request-id": request_id})


def restarting(record: UsageRecord) -> bytes:
    """The event that ends a stream its process stops before its end; the record says so."""
    record.failed("relay", 503, code="server_restarting", status="aborted", message=RESTARTING)
    error = {"error": {"message": RESTARTING, "type": "server_error", "param": None, "code": "server_restarting"}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


def relay_stream(request_id, tier, flight, prepared, response, instance, started, slot=None):
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
            current_process().engines.outstanding[instance.id] -= 1
            if slot is not None:
                await slot.release()
            if not progress["finished"] and record.status == "ok":
                aborted(record, "relay", left="the client closed the stream before its end",
                        http_status=record.http_status)
            if not record.output_tokens:
                record.output_tokens = flight.produced  # what was generated before the end
            await hand_over_usage(record, started)  # its hand-over survives this task being cancelled

    async def events():
        lines = watched_lines(response, tier.id, instance.id)
        try:
            async for line in lines:
                if line is STREAMS_ENDING:
                    if progress.get("finishing"):
                        continue  # its end is on its way: let it come
                    # Its process stops before the stream would end: ended cleanly, billed as relayed.
                    yield restarting(record)
                    return
                if not line.startswith("data:"):
                    continue
                if slot is not None and slot.held:
                    await slot.release()  # its prefill is done: the engine's next image may start
                data = line[5:].strip()
                if data == "[DONE]":
                    progress["finished"] = True
                    yield b"data: [DONE]\n\n"
                    continue
                try:
                    chunk = orjson.loads(data)
                except ValueError:
                    continue
                if "model" in chunk:
                    chunk["model"] = tier.name
                if chunk.get("usage"):
                    apply_engine_usage(record, chunk["usage"], prepared, tier.family)
                    chunk["usage"] = client_usage(chunk["usage"], prepared)
                    if not chunk.get("choices") and not client_wants_usage:
                        continue
                    if not client_wants_usage:
                        chunk.pop("usage")
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason"):
                        progress["finishing"] = True  # its end is on its way: let it come
                    if (choice.get("delta") or {}).get("content"):
                        flight.produced += 1  # also what the journal bills if this gateway dies
                        if record.capture is not None:
                            record.capture.setdefault("parts", []).append(choice["delta"]["content"])
                        if record.ttft_ms is None:
                            record.ttft_ms = ms_since(started)
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except (upstream.Broken, EngineFailing) as exc:
            # The engine dropped the stream, or hung: tell the client in the stream's own terms.
            log.warning("engine %s broke the stream of %s: %s", instance.id, request_id, exc)
            message = "the engine failed while streaming; retry the request"
            record.failed("relay", 502, code="engine_error", message=message)
            error = {"error": {"message": message, "type": "server_error", "param": None, "code": "engine_error"}}
            yield b"data: " + orjson.dumps(error) + b"\n\n"
        finally:
            await lines.aclose()
            await close()

    return Response(stream=events(), content_type="text/event-stream", on_close=close,
                    headers={"cache-control": "no-cache", "x-request-id": request_id})
