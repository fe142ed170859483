"""Turn a tenant's chat request into what the engine receives, and count its tokens.

Pure Python (no Django): images go through the tier's resolution policy, client-supplied
multimodal UUIDs are dropped, image and text tokens are counted before anything is sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from controlplane.imaging.errors import ImageError
from controlplane.imaging.fetch import FetchPolicy
from controlplane.imaging.fingerprint import FingerprintIndex
from controlplane.imaging.intake import image_source_bytes
from controlplane.imaging.policy import NormalisedImage, Policy, normalise_tiles
from controlplane.imaging.tokens import count_image_tokens
from controlplane.textcount import prompt_text_tokens

# Re-encodings of a picture this process has seen get that picture's fingerprint.
index_of_pictures = FingerprintIndex()


class RequestInvalid(ValueError):
    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class TierSpec:
    id: int
    name: str
    family: str
    kind: str
    policy: Policy | None
    processor_options: dict
    large_image_threshold: int
    max_output_tokens: int
    price_plan_id: int
    fetch_policy: FetchPolicy | None = None  # None: image URLs are refused


@dataclass
class PreparedImage:
    image: NormalisedImage
    tokens: int


@dataclass
class Prepared:
    body: dict
    images: list[PreparedImage] = field(default_factory=list)
    text_tokens: int = 0

    @property
    def image_tokens(self) -> int:
        return sum(p.tokens for p in self.images)


def image_parts(messages: list) -> list[dict]:
    """Every image part of a chat request, in order."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(
                part for part in content
                if isinstance(part, dict) and part.get("type") in ("image_url", "input_image")
            )
    return found


def validate_body(body) -> None:
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestInvalid("you must provide a model parameter", param="model", code="missing_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestInvalid("messages must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestInvalid(f"messages[{index}] must be an object with a role", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestInvalid(f"messages[{index}].content must be a string or an array",
                                 param="messages")
    n = body.get("n", 1)
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise RequestInvalid("only n=1 is supported", param="n")
    if body.get("stream") not in (None, True, False):
        raise RequestInvalid("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestInvalid("stream_options must be an object", param="stream_options")
        if options.get("include_usage") not in (None, True, False):
            raise RequestInvalid("stream_options.include_usage must be a boolean",
                                 param="stream_options")
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RequestInvalid(f"{name} must be a positive integer", param=name)


async def prepare(body: dict, tier: TierSpec, *, max_image_bytes: int) -> Prepared:
    parts = image_parts(body["messages"])
    if parts and tier.kind != "vision":
        raise RequestInvalid(f"model {tier.name} does not accept images", param="messages",
                             code="images_not_supported")
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None and limit > tier.max_output_tokens:
        raise RequestInvalid(
            f"max_tokens {limit} exceeds this model's limit of {tier.max_output_tokens}",
            param="max_tokens",
        )
    prepared = Prepared(body=body, text_tokens=prompt_text_tokens(body["messages"]))
    if not parts:
        return prepared
    policy = tier.policy
    if len(parts) > policy.max_images_per_request:
        raise RequestInvalid(
            f"{len(parts)} images in one request; this model takes at most "
            f"{policy.max_images_per_request}", param="messages", code="too_many_images",
        )
    total_pixels = 0
    replacements: dict[int, list[dict]] = {}
    for index, part in enumerate(parts):
        key = "image_url" if part.get("type") == "image_url" else "input_image"
        spec = part.get(key)
        url, detail = (spec, None) if isinstance(spec, str) else (
            (spec.get("url"), spec.get("detail")) if isinstance(spec, dict) else (None, None)
        )
        if not isinstance(url, str) or not url:
            raise RequestInvalid(f"image {index + 1} has no url", param="messages")
        try:
            data = await asyncio.to_thread(image_source_bytes, url, max_bytes=max_image_bytes,
                                           fetch=tier.fetch_policy)
            tiles = await asyncio.to_thread(normalise_tiles, data, policy, detail=detail, index=index_of_pictures)
        except ImageError as exc:
            raise RequestInvalid(f"image {index + 1}: {exc}", param="messages", code=exc.code) from None
        total_pixels += tiles[0].source_width * tiles[0].source_height
        if total_pixels > policy.max_total_pixels:
            raise RequestInvalid(
                f"images in this request exceed {policy.max_total_pixels} pixels in total",
                param="messages", code="image_too_large",
            )
        for tile in tiles:
            try:
                tokens = count_image_tokens(tier.family, tile.width, tile.height, **tier.processor_options)
            except ValueError as exc:
                raise RequestInvalid(f"image {index + 1}: {exc}", param="messages",
                                     code="image_policy_violation") from None
            prepared.images.append(PreparedImage(image=tile, tokens=tokens))
        # What the engine receives: the normalised image (or its tiles, in reading order),
        # without the client's multimodal UUID or detail hint.
        replacements[id(part)] = [{"type": "image_url", "image_url": {"url": t.data_url()}} for t in tiles]
    if len(prepared.images) > policy.max_images_per_request:
        raise RequestInvalid(
            f"the images of this request make {len(prepared.images)} images once long ones are "
            f"tiled; this model takes at most {policy.max_images_per_request}",
            param="messages", code="too_many_images",
        )
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                new for part in content
                for new in (replacements.get(id(part)) or [part])
            ]
    return prepared
