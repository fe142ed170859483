"""What a request whose tenant or key asks for it (`capture_bodies`, off by default) keeps for
debugging: its body with each image as a small thumbnail of what the engine was sent, and its
answer, each string cut at CAPTURE_MAX_CHARS. Stored with the request's usage, outside its
path; only operators see it (metering.models.RequestCapture)."""

from __future__ import annotations

import copy
import io
import logging

import pybase64
from django.conf import settings
from PIL import Image

from controlplane.gateway.validation import image_parts, image_url_place
from controlplane.metering.models import RequestCapture
from controlplane.metering.records import UsageRecord

log = logging.getLogger(__name__)
THUMBNAIL_SIDE = 160


def thumbnail_url(data: bytes) -> str:
    """A JPEG at most THUMBNAIL_SIDE on a side, as a data URL."""
    with Image.open(io.BytesIO(data)) as picture:
        picture = picture.convert("RGB")
        picture.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
        out = io.BytesIO()
        picture.save(out, "JPEG", quality=70)
    return f"data:image/jpeg;base64,{pybase64.b64encode_as_string(out.getvalue())}"


def _cut(value):
    limit = settings.CAPTURE_MAX_CHARS
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}… ({len(value) - limit:,} characters cut)"
    if isinstance(value, list):
        return [_cut(item) for item in value]
    if isinstance(value, dict):
        return {key: _cut(item) for key, item in value.items()}
    return value


def request_of(body: dict, prepared) -> dict:
    """The body to keep: each image part's URL a thumbnail of the image the engine was sent (a
    long image's first tile), the other strings cut."""
    kept = copy.deepcopy({key: value for key, value in body.items() if key != "messages"})
    messages = copy.deepcopy(body["messages"])
    sent = {}
    for image in prepared.images:
        sent.setdefault(image.number, image.image)
    for number, part in enumerate(image_parts(messages), start=1):
        holder, key = image_url_place(part)
        if holder is None:
            continue
        picture = sent.get(number)
        try:
            holder[key] = thumbnail_url(picture.data) if picture is not None else "(not read)"
        except Exception:  # noqa: BLE001 - a picture Pillow cannot thumbnail is noted, not fatal
            holder[key] = f"(an image of {picture.width}×{picture.height})"
    return {**_cut(kept), "messages": _cut(messages)}


def response_of(text: str) -> str:
    return _cut(text)


def capture_store(record: UsageRecord) -> None:
    """Keep the request's capture (once per request id), made here, off the event loop: its
    body with thumbnails, and its answer (its error when it failed)."""
    capture = record.capture
    response = capture.get("response") or "".join(capture.get("parts", ())) or (
        f"{record.error_code}: {record.error_message}" if record.error_code else "")
    try:
        RequestCapture.objects.update_or_create(request_id=record.request_id, defaults={
            "tenant_id": record.tenant_id, "created_at": record.created_at,
            "request": request_of(capture["body"], capture["prepared"]), "response": response_of(response)})
    except Exception:  # debugging aid: never the request's failure
        log.exception("could not keep the capture of %s", record.request_id)
