"""A request's usage as the gateway hands it over: the record, its JSON form (the journal,
the usage stream, the spool), and the rule of what is billed."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import NamedTuple

from django.utils import timezone

from controlplane.metering.rating import Rates, price_parts

CUT_SHORT = ("aborted", "interrupted")  # billed only if an engine worked on them
# Where a request that failed stopped: its key checked, its body and images read, an engine
# chosen, its quota admitted, the engine's work, the answer relayed to the client. A request
# refused at authentication, or at intake before its model was known, has no tier.
STAGES = {
    "authentication": "checking its API key",
    "intake": "reading the request and its images",
    "routing": "choosing an engine",
    "admission": "admission against quotas",
    "engine": "the engine",
    "relay": "relaying the answer",
}
ERROR_MESSAGE_CHARS = 300


@dataclass
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    tier_id: int | None  # None: refused before its model was known (never billed)
    stream: bool = False
    images: list = field(default_factory=list)  # (NormalisedImage, tokens, of which from the prefix cache)
    image_tokens: int = 0
    text_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine reused from its prefix cache
    cached_image_tokens: int = 0  # of which image tokens (each image's share of the cached prefix)
    # The engine's own count of image tokens (vLLM's multimodal_tokens.image), None when it
    # reported none; and whether it disagrees with the gateway's image_tokens.
    engine_image_tokens: int | None = None
    image_tokens_disagree: bool = False
    # The gateway's own prompt count before forwarding (text and images), and whether its
    # text part was the estimate rather than the tier's tokenizer's exact count.
    counted_prompt_tokens: int | None = None
    prompt_estimated: bool = True
    instance_id: int | None = None
    status: str = "ok"
    http_status: int = 200
    latency_ms: int = 0  # from arrival at the gateway to the last byte of the answer
    # Where the time went: preparing the images (decode, resize, count), waiting in the
    # gateway (admission, a large-image turn) before an engine was sent the request, and
    # from arrival to the first token streamed (None when not streamed or never reached).
    prepare_ms: int | None = None
    queue_ms: int | None = None
    ttft_ms: int | None = None
    created_at: dt.datetime = field(default_factory=timezone.now)
    reservation: object = None  # the quota reservation to settle (gateway only)
    # The checks of its images sent as they came (gateway only): its image lines get their
    # fingerprints from them, whether or not they had finished when it was admitted.
    checking: object = None
    # Its admission, when that ran beside the engine's work (gateway only): the record is
    # handed over once the admission has its answer.
    admission: object = None
    recorded: bool = False  # set once the gateway has handed the record over
    # A cascade's first attempt (gateway only): called with the engine's answer before the
    # record is handed over, to say whether that answer is escalated (gateway/cascade.py).
    judge: object = None
    # Its body and answer to keep for debugging, when its tenant or key asks (gateway only):
    # {"body", "prepared", and "response" or "parts": [streamed text]} (gateway/capture.py).
    capture: dict | None = None
    # Why it failed, when it did: the stage (STAGES), the error's code and message as the client
    # was told them, and the parameter it named ("messages[0].content[1]": which image).
    error_stage: str = ""
    error_code: str = ""
    error_message: str = ""
    error_param: str = ""
    # How `auto` chose it, when a routing rule did (gateway/rules.py); a cascade's escalation
    # names the first attempt it followed, and the first attempt why it was escalated ("" when
    # its answer was sent) and how sure its answer was.
    routed_by: str = ""
    cascade_of: str = ""
    escalation: str = ""
    confidence: float | None = None

    def failed(self, stage: str, http_status: int, *, code: str = "", message: str = "", param: str = "",
               status: str = "error") -> UsageRecord:
        self.status, self.http_status = status, http_status
        self.error_stage, self.error_code, self.error_param = stage, code, param[:120]
        self.error_message = message[:ERROR_MESSAGE_CHARS]
        return self


# Why a cascade's first answer was escalated (UsageRecord.escalation), and what it means.
ESCALATIONS = {"low_confidence": "unsure: its token probability below the rule's threshold",
               "no_confidence": "unsure: the engine gave no token probabilities",
               "length": "cut short by max_tokens", "refusal": "a refusal", "no_answer": "no answer"}

_SCALARS = ("request_id", "tenant_id", "api_key_id", "tier_id", "stream", "image_tokens", "text_tokens",
            "output_tokens", "cached_tokens", "cached_image_tokens", "instance_id", "status", "http_status",
            "latency_ms", "engine_image_tokens", "image_tokens_disagree", "counted_prompt_tokens", "prompt_estimated",
            "prepare_ms", "queue_ms", "ttft_ms", "error_stage", "error_code", "error_message", "error_param",
            "routed_by", "cascade_of", "escalation", "confidence")
# Fields newer than some records already in flight (streams and journals outlive a deploy).
_SCALAR_DEFAULTS = {"engine_image_tokens": None, "image_tokens_disagree": False, "counted_prompt_tokens": None,
                    "prompt_estimated": True, "prepare_ms": None, "queue_ms": None, "ttft_ms": None,
                    "error_stage": "", "error_code": "", "error_message": "", "error_param": "",
                    "routed_by": "", "cascade_of": "", "escalation": "", "confidence": None}
_IMAGE_FIELDS = ("source_format", "source_width", "source_height", "width", "height", "fingerprint", "tile", "tiles")


class ImageLine(NamedTuple):
    """What metering keeps of an image (never its pixels). A named tuple: the ingest makes
    thousands a second, and a frozen dataclass costs five times as much to make."""

    source_format: str
    source_width: int
    source_height: int
    width: int
    height: int
    fingerprint: str
    tile: int = 0  # its place among the tiles of a long picture cut by the policy
    tiles: int = 1


def usage_to_json(record: UsageRecord) -> dict:
    """A record as plain JSON, for the usage stream."""
    data = {name: getattr(record, name) for name in _SCALARS}
    data["created_at"] = record.created_at.isoformat()
    data["images"] = [[{f: getattr(image, f) for f in _IMAGE_FIELDS}, tokens, cached]
                      for image, tokens, cached in image_lines(record.images)]
    return data


_REQUIRED = tuple(name for name in _SCALARS if name not in _SCALAR_DEFAULTS)


def usage_from_json(data: dict) -> UsageRecord:
    values = {name: data[name] for name in _REQUIRED}
    for name, default in _SCALAR_DEFAULTS.items():
        values[name] = data.get(name, default)
    record = UsageRecord(**values, created_at=dt.datetime.fromisoformat(data["created_at"]))
    record.images = image_lines([(ImageLine(**image), tokens, cached) for image, tokens, cached in data["images"]])
    return record


def image_lines(images: list) -> list:
    """(image, tokens, cached tokens) lines. A pair is an image none of which came from the
    cache; a flag (records made before shares were kept) means all of it or none."""
    lines = []
    for item in images:
        image, tokens, cached = item if len(item) == 3 else (*item, 0)
        if isinstance(cached, bool):
            cached = tokens if cached else 0
        lines.append((image, tokens, int(cached)))
    return lines


def is_billable(record: UsageRecord) -> bool:
    """Completed work is billed, and so is work an engine did for a client that left; a request
    refused or failed before an engine worked on it is not. Work interrupted by a gateway crash
    is billed as far as its journal knew. A request refused before its model was known has no
    tier to price it by, and no engine worked on it."""
    if record.tier_id is None:
        return False
    return record.status == "ok" or (record.status in CUT_SHORT and record.instance_id is not None)


def priced_lines(record: UsageRecord) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(tokens, cached) per image line as they are priced, the per-image report's way; and the
    image tokens (and cached) a record counts without lines.

    Lines carry their cached share. A record whose lines carry none but which counts cached
    image tokens (made before shares were kept) has them laid over its images in order, as
    a prefix cache covers a prompt from its start."""
    lines = [(tokens, min(cached, tokens)) for _, tokens, cached in record.images]
    cached = min(record.cached_image_tokens, record.image_tokens)
    if not lines:
        return [], (record.image_tokens, cached)
    if cached and not any(share for _, share in lines):
        spread = []
        for tokens, _ in lines:
            share = min(tokens, cached)
            spread.append((tokens, share))
            cached -= share
        lines = spread
    return lines, (0, 0)


def record_price(record: UsageRecord, rates: Rates) -> Decimal:
    """What a record costs at `rates`, part by part as its bill prices it (see rating.py)."""
    record.images = image_lines(record.images)
    lines, unlined = priced_lines(record)
    return price_parts(images=lines, unlined=unlined, text_tokens=record.text_tokens,
                       output_tokens=record.output_tokens, rates=rates).total
