"""Turn a tenant's chat request into what the engine receives, and count its tokens.

Pure Python (no Django): images go through the tier's resolution policy, client-supplied
multimodal UUIDs are dropped, image and text tokens are counted before anything is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from controlplane.gateway.repeats import Key, Picture, Repeats, digest
from controlplane.gateway.validation import (
    RequestInvalid,
    image_detail,
    image_parts,
    image_url_place,
)
from controlplane.imaging.budget import DecodeBudget
from controlplane.imaging.errors import ImageError
from controlplane.imaging.fetch import FetchPolicy
from controlplane.imaging.fingerprint import FingerprintIndex
from controlplane.imaging.intake import image_source_bytes
from controlplane.imaging.policy import DecodedDataURL, NormalisedImage, Policy, normalise_tiles
from controlplane.imaging.tokens import count_image_tokens, image_markers
from controlplane.prompts import TemplateError
from controlplane.textcount import image_positions, prompt_text_tokens


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
    max_model_len: int = 32768
    priority_scheduling: bool = False  # the engine runs --scheduling-policy priority
    require_moderation: bool = False  # the prompt, text and images, goes through moderation first
    large_image_concurrency: int = 2  # large images in prefill at once, when the tier has no large-image pool
    image_prefill_slots: int = 2  # image requests in prefill at once per engine
    fetch_policy: FetchPolicy | None = None  # None: image URLs are refused
    tool_calls: bool = False  # the engine runs with a tool-call parser (engine setting tool_call_parser)
    tokenizer: object = None  # the model's ChatTokenizer (controlplane.prompts), when the tier has one
    priced: bool = True  # its price plan has a rate in effect; without one nothing is forwarded
    rates: object = None  # that rate's amounts (metering.rating.Rates), what budgets count a request at
    currency: str = ""  # and its plan's currency
    default_for_text: bool = False  # where `auto` goes (controlplane/catalog/routing.py)
    default_for_images: bool = False


@dataclass
class PreparedImage:
    image: NormalisedImage
    tokens: int
    position: int = 0  # where the image starts in the prompt
    number: int = 1  # which image of the request it is (its tiles share it), for what is said of it
    # A digest of the bytes the engine is sent: the engine that was sent them has their encoding
    # in its caches (vLLM's are keyed by the pixels, so a re-encoding of the picture would miss).
    key: str = ""
    # An image sent as it came: its picture's check (started as soon as it was known to go as
    # it came, running beside the rest of the request), and which of the picture's images it is.
    checking: tuple[Future, int] | None = None


@dataclass
class Prepared:
    body: dict
    images: list[PreparedImage] = field(default_factory=list)
    text_tokens: int = 0
    # True when text_tokens and the images' positions are the estimate, not the model's
    # own tokenizer's count (the tier has none, or its chat template failed on the request).
    estimated: bool = True
    # The checks of the images sent as they came (decoded whole, fingerprinted), running beside
    # the request's admission and its trip to the engine; its result is `images`, all checked.
    checking: asyncio.Future | None = None
    # What its pictures may cost and have cost to decode (their CPU time, checks included).
    budget: DecodeBudget | None = None
    # Per picture: whether what it became was kept from a request that sent it before.
    pictures_again: list[bool] = field(default_factory=list)

    @property
    def image_tokens(self) -> int:
        return sum(p.tokens for p in self.images)

    def check_images(self) -> None:
        """Gather the checks of the images sent as they came, which have been running since."""
        pending = [p for p in self.images if p.checking is not None]
        if pending and self.checking is None:
            self.checking = asyncio.ensure_future(self._checked(pending))
            # Never waited on when the request ends before it is answered (the client left).
            self.checking.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def images_checked(self) -> list[PreparedImage]:
        """The images once every check has passed; RequestInvalid for the first that failed."""
        if self.checking is not None:
            await asyncio.shield(self.checking)  # a caller giving up does not stop the check
        return self.images

    async def _checked(self, pending: list[PreparedImage]) -> list[PreparedImage]:
        for prepared in pending:
            checking, tile = prepared.checking
            try:
                prepared.image = (await asyncio.wrap_future(checking))[tile][0]
            except ImageError as exc:
                raise RequestInvalid(f"image {prepared.number}: {exc}", param="messages", code=exc.code) from None
        return self.images


def _check(images: Picture, keep: tuple[Repeats, Key] | None) -> Picture:
    """A picture's images sent as they came, checked (ImageError for the first that fails);
    kept for the requests that send it again once they all passed."""
    checked = tuple((image.checked(), sent) for image, sent in images)
    if keep is not None:
        repeats, key = keep
        repeats.put(key, checked)
    return checked


@dataclass(frozen=True)
class _Picture:
    images: Picture  # each image it became, and its `digest`
    again: bool = False  # what it became when it was sent before (nothing was decoded)
    checking: Future | None = None  # the check of an image sent as it came: its images checked


@dataclass(frozen=True)
class Seen:
    """What a gateway process keeps of the pictures it prepares (its GatewayProcess holds it):
    the fingerprints of those seen, which re-encodings of them get, and the threads on which
    an image sent as it came is checked. Without it, nothing is recognised and checks run at
    once, on the preparing thread."""

    index: FingerprintIndex | None = None
    checks: Callable[[], Executor] | None = None

    def check(self, images: Picture, keep) -> Future:
        if self.checks is not None:
            return self.checks().submit(_check, images, keep)
        done: Future = Future()
        try:
            done.set_result(_check(images, keep))
        except Exception as exc:  # noqa: BLE001 - the check's failure, awaited as a thread's would be
            done.set_exception(exc)
        return done


async def _picture(url: str | DecodedDataURL, policy: Policy, detail, fetch: FetchPolicy | None, max_bytes: int,
                   scope: str, repeats: Repeats | None, budget: DecodeBudget, seen: Seen) -> _Picture:
    """Each image the picture at `url` becomes, and the digest of its bytes; or what it became
    when this tenant sent it before (`repeats`). A data URL's bytes are at hand (decoded as the
    body was read, or here: a 1 MP photo's in 0.03 ms), so a picture this process kept is found
    on the event loop: a picture sent again never waits for a worker thread behind the new
    ones being prepared (and saves the trip, 0.1 ms). Everything else is done on one. Its
    pixels and what decoding it costs are taken from `budget`."""
    if not (isinstance(url, DecodedDataURL) or url.startswith("data:")):
        return await asyncio.to_thread(_fetched_tiles, url, policy, detail, fetch, max_bytes, scope, repeats, budget,
                                       seen)
    data = image_source_bytes(url, max_bytes=max_bytes, fetch=None)
    key = _key(data, policy, detail, scope, repeats)
    if key is not None and (kept := repeats.kept_here(key)) is not None:
        return _again(kept, scope, budget, seen)
    return await asyncio.to_thread(_image_tiles, data, key, policy, detail, scope, repeats, budget, seen)


def _fetched_tiles(url: str, policy: Policy, detail, fetch: FetchPolicy | None, max_bytes: int, scope: str,
                   repeats: Repeats | None, budget: DecodeBudget, seen: Seen) -> _Picture:
    data = image_source_bytes(url, max_bytes=max_bytes, fetch=fetch)
    return _image_tiles(data, _key(data, policy, detail, scope, repeats), policy, detail, scope, repeats, budget,
                        seen)


def _key(data: bytes, policy: Policy, detail, scope: str, repeats: Repeats | None) -> Key | None:
    """What the picture is kept under, when pictures are kept."""
    if repeats is None or not repeats.max_bytes:
        return None
    return Key.of(data, scope=scope, policy=policy, cap=policy.pixel_cap(detail))  # a bad detail refused here


def _again(kept: Picture, scope: str, budget: DecodeBudget, seen: Seen) -> _Picture:
    first = kept[0][0]
    budget.count_pixels(first.source_width, first.source_height)  # nothing decoded, but in the request's total
    for image, _ in kept:  # its fingerprint stays among the tenant's recent pictures
        if seen.index is not None:
            seen.index.touch(image.fingerprint, scope=scope)
    return _Picture(kept, again=True)


def _image_tiles(data: bytes, key: Key | None, policy: Policy, detail, scope: str, repeats: Repeats | None,
                 budget: DecodeBudget, seen: Seen) -> _Picture:
    """Normalise, on a worker thread (CPU work, off the event loop): each image the picture
    becomes, and the digest of its bytes; or what it became, kept by another replica
    (`repeats`' shared store). An image sent as it came has its check started here, on the
    checks' threads, to run beside the rest of the request and its trip to the engine
    (Prepared.check_images); it is kept once it passed."""
    if key is not None and (kept := repeats.get(key)) is not None:
        return _again(kept, scope, budget, seen)
    index = seen.index.scoped(scope) if seen.index is not None else None
    tiles = normalise_tiles(data, policy, detail=detail, index=index, check_later=True, budget=budget)
    images = tuple((tile, digest(tile.data)) for tile in tiles)
    if any(tile.check is not None for tile in tiles):
        keep = None if key is None else (repeats, key)
        return _Picture(images, checking=seen.check(images, keep))
    if key is not None:
        repeats.put(key, images)
    return _Picture(images)


async def prepare(body: dict, tier: TierSpec, *, max_image_bytes: int, scope: str = "",
                  repeats: Repeats | None = None, budget: DecodeBudget | None = None,
                  seen: Seen = Seen()) -> Prepared:
    """`scope`: whose request it is (a tenant's pictures are recognised among its own only).
    `repeats`: what pictures sent before became, for those sent again (none kept without).
    `seen`: the process's fingerprints of pictures seen, and its threads for checks.
    `budget`: what decoding the request's pictures may cost, and the CPU they took (see
    imaging/budget.py); by default, the tier's policy's pixel total and the default limits."""
    parts = image_parts(body["messages"])
    if parts and tier.kind != "vision":
        raise RequestInvalid(f"model {tier.name} does not accept images", param="messages",
                             code="images_not_supported")
    if body.get("tools") and body.get("tool_choice", "auto") not in (None, "none") and not tier.tool_calls:
        # vLLM refuses these with a 400 unless it runs with a tool-call parser: say so here,
        # before the images are prepared and the quota is reserved.
        raise RequestInvalid(f"model {tier.name} does not support tool calls (its engine runs "
                             "without a tool-call parser); send no tools, or tool_choice 'none'",
                             param="tools", code="tools_not_supported")
    limit = body.pop("max_completion_tokens", None) or body.get("max_tokens")
    if limit is not None and limit > tier.max_output_tokens:
        raise RequestInvalid(
            f"max_tokens {limit} exceeds this model's limit of {tier.max_output_tokens}",
            param="max_tokens",
        )
    prepared = Prepared(body=body)
    try:
        if parts:
            prepared.budget = budget or DecodeBudget(pixels=tier.policy.max_total_pixels)
            await _prepare_images(prepared, parts, tier, max_image_bytes=max_image_bytes, scope=scope,
                                  repeats=repeats, seen=seen)
        _lay_out(prepared, tier)
        # Always bounded: without a limit the engine would generate up to the rest of its context.
        room = tier.max_model_len - prepared.text_tokens - prepared.image_tokens
        if room < 1:
            raise RequestInvalid(
                f"this request needs about {tier.max_model_len - room} prompt tokens; the model's context "
                f"is {tier.max_model_len}", param="messages", code="context_length_exceeded")
    except RequestInvalid:
        # Refused for something else: an image sent as it came that fails its check (a broken
        # JPEG, a polyglot) is refused for that all the same, as it would have been at intake.
        prepared.check_images()
        await prepared.images_checked()
        raise
    body["max_tokens"] = min(limit or tier.max_output_tokens, room)
    prepared.check_images()
    return prepared


async def _prepare_images(prepared: Prepared, parts: list[dict], tier: TierSpec, *, max_image_bytes: int,
                          scope: str, repeats: Repeats | None, seen: Seen) -> None:
    body = prepared.body
    policy = tier.policy
    if len(parts) > policy.max_images_per_request:
        raise RequestInvalid(
            f"{len(parts)} images in one request; this model takes at most "
            f"{policy.max_images_per_request}", param="messages", code="too_many_images",
        )
    replacements: dict[int, list[dict]] = {}
    for index, part in enumerate(parts):
        holder, field = image_url_place(part)
        url = None if holder is None else holder.get(field)
        detail = image_detail(part)
        if not isinstance(url, str | DecodedDataURL) or not url:
            raise RequestInvalid(f"image {index + 1} has no url", param="messages")
        try:
            picture = await _picture(url, policy, detail, tier.fetch_policy, max_image_bytes, scope, repeats,
                                     prepared.budget, seen)
        except ImageError as exc:
            raise RequestInvalid(f"image {index + 1}: {exc}", param="messages", code=exc.code) from None
        tiles = picture.images
        for number, (tile, sent) in enumerate(tiles):
            try:
                tokens = count_image_tokens(tier.family, tile.width, tile.height, **tier.processor_options)
            except ValueError as exc:
                raise RequestInvalid(f"image {index + 1}: {exc}", param="messages",
                                     code="image_policy_violation") from None
            prepared.images.append(PreparedImage(
                image=tile, tokens=tokens, number=index + 1, key=sent,
                checking=None if tile.check is None else (picture.checking, number)))
        prepared.pictures_again.append(picture.again)
        # What the engine receives: the normalised image (or its tiles, in reading order),
        # without the client's multimodal UUID or detail hint.
        replacements[id(part)] = [{"type": "image_url", "image_url": {"url": t.data_url()}} for t, _ in tiles]
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


def _lay_out(prepared: Prepared, tier: TierSpec) -> None:
    """Text tokens and image positions: exact with the tier's tokenizer, else the estimate."""
    messages, image_tokens = prepared.body["messages"], [p.tokens for p in prepared.images]
    markers = image_markers(tier.family)
    layout = None
    if tier.tokenizer is not None and (markers is not None or not image_tokens):
        try:
            layout = tier.tokenizer.layout(messages, image_tokens, markers=markers or 0,
                                           tools=prepared.body.get("tools"))
        except TemplateError:
            layout = None  # the engine's own template will say what is wrong, if anything is
    if layout is not None:
        prepared.text_tokens, positions, prepared.estimated = layout.text_tokens, layout.image_positions, False
    else:
        prepared.text_tokens, positions = prompt_text_tokens(messages), image_positions(messages, image_tokens)
    for image, position in zip(prepared.images, positions, strict=True):
        image.position = position
