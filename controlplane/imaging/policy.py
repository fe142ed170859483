"""Resolution policy: the first cost gate of VLM serving.

`normalise_tiles` decodes untrusted bytes safely, applies the EXIF orientation, flattens
to RGB, brings the image within the policy's pixel bounds (long images are cut into tiles
in reading order rather than squashed) and re-encodes it for the engine. Downscaling is
cheap: JPEGs decode straight at 1/2, 1/4 or 1/8 scale in the DCT domain when that still
covers the target, then one bicubic resample (libvips', resample.py) finishes the job.
Pure Python: no Django, no Celery.
"""

from __future__ import annotations

import binascii
import functools
import io
import math
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pybase64  # SIMD base64: a 12 MP photo's data URL in ~0.2 ms instead of ~7
from PIL import Image

from controlplane.imaging import rows
from controlplane.imaging.budget import DEFAULT_MAX_SCANS, DecodeBudget, decode_memory
from controlplane.imaging.decode import (
    SUPPORTED_FORMATS,
    PolyglotImage,
    as_image,
    check_input_size,
    decode_jpeg,
    embedded_document,
    open_image,
    orientation,
    sniff_problem,
    source_format,
    to_rgb,
    turbo_decodable,
    upright,
)
from controlplane.imaging.errors import (
    CorruptImage,
    ImageTooComplex,
    ImageTooLarge,
    InvalidDataURL,
    PolicyViolation,
)
from controlplane.imaging.fingerprint import (
    FingerprintIndex,
    fingerprint,
    fingerprint_of_bits,
    narrowed_bits,
)
from controlplane.imaging.resample import CORES, bicubic, bicubic_rgb
from controlplane.threads import Threads

__all__ = ["SUPPORTED_FORMATS", "DecodedDataURL", "NormalisedImage", "Policy", "decode_data_url",
           "decoded_data_url", "fit_within", "normalise", "normalise_tiles", "picture_sent_sizes", "picture_size",
           "plan_tiles",
           "sent_sizes"]

_MIME = {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp"}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,")


@dataclass(frozen=True)
class Policy:
    min_pixels: int = 3136
    max_pixels: int = 1003520
    low_detail_max_pixels: int = 200704
    default_detail: str = "high"
    max_long_edge: int = 4096
    max_aspect_ratio: float = 4.0  # the model's default (catalog.models.ResolutionPolicy)
    tile_long_images: bool = True
    max_images_per_request: int = 8
    max_total_pixels: int = 16_000_000
    max_input_pixels: int = 50_000_000
    allowed_formats: tuple[str, ...] = ()
    output_format: str = "jpeg"
    output_quality: int = 85
    # The side multiple the model's processor resizes to (Qwen2.5-VL: 28); 0 for none. A
    # downscaled image is sized on it, as the processor would size the original, so the engine
    # does not resize it again (rounding a gateway-sized image up cost up to 3 % more tokens).
    grid: int = 0

    def pixel_cap(self, detail: str | None) -> int:
        if detail in (None, "auto"):
            detail = self.default_detail
        if detail == "low":
            return self.low_detail_max_pixels
        if detail == "high":
            return self.max_pixels
        raise PolicyViolation(f"detail must be 'low', 'high' or 'auto', not {detail!r}")


@dataclass(frozen=True)
class NormalisedImage:
    source_format: str
    source_width: int
    source_height: int
    width: int
    height: int
    data: bytes
    mime: str
    fingerprint: str
    tile: int = 0  # position in reading order when a long image was cut
    tiles: int = 1
    # An image sent as it came whose check was left for later (normalise_tiles' check_later):
    # its fingerprint is "" until `checked()` has decoded it.
    check: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    def checked(self) -> NormalisedImage:
        """This image checked (CorruptImage if it is not a whole JPEG) and fingerprinted."""
        return self if self.check is None else replace(self, fingerprint=self.check(), check=None)

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{pybase64.b64encode_as_string(self.data)}"


def decode_data_url(url: str, *, max_bytes: int) -> bytes:
    match = _DATA_URL.match(url[:256])
    if match is None:
        raise InvalidDataURL("image_url must be a data: URL (data:image/...;base64,...)")
    if not match.group("b64"):
        raise InvalidDataURL("image data URLs must be base64 encoded (;base64,)")
    payload = url[match.end():]
    padding = len(payload) - len(payload.rstrip("="))
    if len(payload) * 3 // 4 - padding > max_bytes:
        raise ImageTooLarge(f"image is larger than {max_bytes} bytes")
    try:
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidDataURL("image data URL is not valid base64") from None
    if not data:
        raise CorruptImage("image data is empty (zero bytes)")
    return data


@dataclass(frozen=True, eq=False)
class DecodedDataURL:
    """A base64 data URL decoded where its request's body was read (controlplane/gateway/body.py),
    so that its megabytes are never made a string: its text as the body carried it, and its
    bytes, exactly what `decode_data_url` returns for that text."""
    text: memoryview  # ASCII
    data: bytes

    def __str__(self) -> str:
        return str(self.text, "ascii")


def decoded_data_url(text: memoryview) -> DecodedDataURL | None:
    """The data URL `text` (bytes as a JSON string carried them, with no escape) decoded, or
    None where `decode_data_url` would not return bytes for it: that is left to refuse it,
    read as a string, with its own error."""
    match = _DATA_URL.match(str(text[:256], "ascii", "replace"))
    if match is None or not match.group("b64") or len(text) == match.end():
        return None
    try:
        data = pybase64.b64decode(text[match.end():], validate=True)  # only the alphabet: ASCII
    except (binascii.Error, ValueError):
        return None
    return DecodedDataURL(text, data) if data else None


def fit_within(width: int, height: int, *, max_pixels: int, max_long_edge: int) -> tuple[int, int]:
    """The largest size with the same aspect ratio inside both bounds; never upscales."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)), max_long_edge / max(width, height))
    if scale >= 1.0:
        return width, height
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


@dataclass(frozen=True)
class TilePlan:
    width: int  # the whole image after scaling
    height: int
    boxes: tuple[tuple[int, int, int, int], ...]  # crops of the scaled image, in reading order


def _on_grid(side: int, grid: int) -> int:
    return max(grid, side // grid * grid) if grid else side


def _processor_size(long_side: int, short_side: int, grid: int, cap: int, policy: Policy) -> tuple[int, int] | None:
    """The size a grid processor (Qwen-VL's) gives a picture over the pixel cap, reckoned as it
    reckons it: it decides on the sides rounded to the grid, and where those are within the cap
    keeps them (one side a little longer than the picture's); otherwise it scales both down by
    the same factor and floors them to the grid. None where the policy's long edge rules."""
    rounded = [round(side / grid) * grid for side in (long_side, short_side)]
    if rounded[0] * rounded[1] > cap:
        beta = math.sqrt(long_side * short_side / cap)
        rounded = [max(grid, math.floor(side / beta / grid) * grid) for side in (long_side, short_side)]
    if not rounded[1] or rounded[0] > policy.max_long_edge:
        return None
    return rounded[0], rounded[1]


def plan_tiles(width: int, height: int, policy: Policy, cap: int) -> TilePlan:
    """How an upright `width` x `height` image becomes one or more images within `policy`."""
    ratio = max(width, height) / min(width, height)
    count = 1
    if ratio > policy.max_aspect_ratio:
        if not policy.tile_long_images:
            raise PolicyViolation(
                f"image aspect ratio {ratio:.1f} exceeds the policy's {policy.max_aspect_ratio:g}")
        count = math.ceil(ratio / policy.max_aspect_ratio)
        if count > policy.max_images_per_request:
            raise PolicyViolation(
                f"image aspect ratio {ratio:.1f} would need {count} tiles; at most "
                f"{policy.max_images_per_request} images are allowed per request")
    tall = height >= width
    long_side, short_side = (height, width) if tall else (width, height)
    # Every tile gets the full pixel cap: a long receipt stays legible tile by tile.
    tile_long = long_side / count
    scale = min(1.0, math.sqrt(cap / (tile_long * short_side)), policy.max_long_edge / max(tile_long, short_side))
    # Equal tiles of a whole number of pixels, so no tile exceeds the budget by rounding.
    # A downscaled image goes down to the processor's grid, as the processor floors a large
    # image itself: the engine then takes it as it is, at the tokens it would give the original.
    grid = policy.grid if scale < 1 else 0
    if count == 1 and grid and (rounded := _processor_size(long_side, short_side, grid, cap, policy)):
        long_side_to, short_side_to = rounded
        scaled = (short_side_to, long_side_to) if tall else (long_side_to, short_side_to)
        return TilePlan(width=scaled[0], height=scaled[1], boxes=((0, 0, *scaled),))
    scaled_short = _on_grid(max(1, math.floor(short_side * scale)), grid)
    piece = max(1, math.floor(tile_long * scale))
    if count > 1:  # flooring the short side must not push a tile past the aspect bound
        piece = min(piece, math.floor(scaled_short * policy.max_aspect_ratio))
    piece = _on_grid(piece, grid)
    scaled_long = piece * count
    boxes = tuple(
        (0, i * piece, scaled_short, (i + 1) * piece) if tall else (i * piece, 0, (i + 1) * piece, scaled_short)
        for i in range(count)
    )
    scaled = (scaled_short, scaled_long) if tall else (scaled_long, scaled_short)
    return TilePlan(width=scaled[0], height=scaled[1], boxes=boxes)


def sent_sizes(width: int, height: int, policy: Policy, detail: str | None = None) -> list[tuple[int, int]]:
    """The size of each image an upright `width` x `height` picture becomes under `policy`
    (its tiles, for a long one): what `normalise_tiles` sends, without decoding anything.
    Refused as `normalise_tiles` would refuse that picture."""
    check_input_size(width, height, policy.max_input_pixels)
    plan = plan_tiles(width, height, policy, policy.pixel_cap(detail))
    return [(right - left, bottom - top) for left, top, right, bottom in plan.boxes]


def picture_size(data: bytes, *, policy: Policy | None = None, max_scans: int = DEFAULT_MAX_SCANS,
                 cpu_seconds: float | None = None) -> tuple[int, int]:
    """The upright size of the picture `data`, read from its header alone (refused as its
    header would be refused under `policy`, the default policy when None; ImageTooComplex past
    `cpu_seconds` of reading it)."""
    policy = policy or Policy()
    sniff_problem(data, documents=False)
    image = open_image(data, allowed_formats=policy.allowed_formats, max_input_pixels=policy.max_input_pixels,
                       max_scans=max_scans, cpu_seconds=cpu_seconds, sniffed=True)
    width, height = image.size
    if orientation(image) in (5, 6, 7, 8):
        width, height = height, width
    return width, height


def picture_sent_sizes(data: bytes, policy: Policy, detail: str | None = None, *,
                       max_scans: int = DEFAULT_MAX_SCANS) -> list[tuple[int, int]]:
    """What `normalise_tiles` would send of the picture `data`, read from its header alone:
    the size of each image it becomes (what its tokens are counted on). Refused as its header
    would be refused; its pixels are not decoded, so a picture broken past its header is not."""
    width, height = picture_size(data, policy=policy, max_scans=max_scans)
    if width * height > policy.max_total_pixels:
        raise ImageTooLarge(f"images in this request exceed {policy.max_total_pixels} pixels in total")
    return sent_sizes(width, height, policy, detail)


def _dct_scale(size: tuple[int, int], target: tuple[int, int]) -> int:
    """The largest JPEG DCT scale (1/8, 1/4, 1/2 or 1) that still covers `target`."""
    for scale in (8, 4, 2):
        if -(-size[0] // scale) >= target[0] and -(-size[1] // scale) >= target[1]:
            return scale
    return 1


def _decode_scaled(image: Image.Image, data: bytes, fmt: str, turn: int, target: tuple[int, int],
                   budget: DecodeBudget):
    """Decode `image` upright, at the smallest scale the JPEG decoder offers above `target`,
    within `budget`'s CPU time (Pillow's decoders: from the image's opening, see open_image).
    Also the decoder's own RGB buffer of the result, when it is one (else None)."""
    width, height = target
    stored_target = (height, width) if turn in (5, 6, 7, 8) else (width, height)
    if turbo_decodable(image):
        raw = decode_jpeg(data, image, _dct_scale(image.size, stored_target), max_scans=budget.limits.max_scans,
                          cpu_seconds=budget.cpu_allowed())
        pixels = as_image(raw)
        if pixels.mode == "RGB" and turn == 1:
            return pixels, raw
        return upright(to_rgb(pixels), turn), None
    if fmt == "JPEG" and (width, height) != image.size:
        image.draft("RGB", stored_target)
    image.load()
    return upright(to_rgb(image), turn), None


def normalise_tiles(data: bytes, policy: Policy, *, detail: str | None = None,
                    index: FingerprintIndex | None = None, check_later: bool = False,
                    budget: DecodeBudget | None = None) -> list[NormalisedImage]:
    """Bring an untrusted image within `policy`; one image, or tiles for a long one.

    With an `index`, re-encodings of a picture seen before get that picture's fingerprint.
    With `check_later`, an image sent as it came is returned once its header has passed
    (format, size, orientation), its search for an embedded document and its decode left to
    its `checked()`: the caller may send it meanwhile (to its own engine, whose decoder reads
    the image and nothing after it), and must not answer before it has passed.
    `budget`: what the picture's request may still spend on its pictures (by default, what
    one picture may: the policy's total pixels, and the default limits); its pixels and
    decode memory are taken from it before anything is decoded, and its CPU time counted.
    """
    cap = policy.pixel_cap(detail)  # a bad detail first, as before
    sniff_problem(data, documents=False)  # empty, or SVG: refused as such, polyglot or not
    documents = _Documents(data)
    budget = budget if budget is not None else DecodeBudget(pixels=policy.max_total_pixels)
    try:
        with budget.timed():
            return _normalised_tiles(data, policy, cap, index, check_later, documents, budget)
    except Exception:
        # A polyglot is refused as a polyglot, whatever else is wrong with it, and whichever
        # way it went (its search may have run beside a large photo's decode).
        if (found := documents.found()) is not None:
            raise found from None
        raise


class _Documents:
    """The search of an image's bytes for an embedded document, run once: beside a large
    photo's decode (on the thread that resamples it, while it waits for the first rows: the
    search took 0.8 ms of a 12 MP photo's path) or before anything else is decoded."""

    def __init__(self, data: bytes):
        self._data, self._lock, self._done, self._found = data, threading.Lock(), False, None

    def found(self) -> PolyglotImage | None:
        with self._lock:
            if not self._done:
                self._found, self._done = embedded_document(self._data), True
            return self._found

    def refuse(self) -> None:
        """PolyglotImage if the bytes carry a document."""
        if (found := self.found()) is not None:
            raise found


def _normalised_tiles(data: bytes, policy: Policy, cap: int, index: FingerprintIndex | None,
                      check_later: bool, documents: _Documents, budget: DecodeBudget) -> list[NormalisedImage]:
    limits = budget.limits
    image = open_image(data, allowed_formats=policy.allowed_formats, max_input_pixels=policy.max_input_pixels,
                       max_scans=limits.max_scans, cpu_seconds=budget.cpu_allowed(), sniffed=True)
    fmt = source_format(image)
    turn = orientation(image)
    stored_w, stored_h = image.size
    width, height = (stored_h, stored_w) if turn in (5, 6, 7, 8) else (stored_w, stored_h)
    plan = plan_tiles(width, height, policy, cap)
    # What the header says the decode will hold and how many pixels the request has left,
    # before a pixel is decoded.
    budget.count_pixels(width, height)
    progressive = fmt == "JPEG" and bool(image.info.get("progressive"))
    memory = decode_memory(stored_w, stored_h, image.mode, coefficients=len(image.getbands()) if progressive else 0)
    if policy.output_format == "jpeg" and _passes_through(image, fmt, turn, plan, (width, height)):
        budget.take_memory(memory)  # its check is held by the checks' pool of threads, one per core
        sent = _as_sent(image, data, index=index, documents=documents, budget=budget)
        return [sent if check_later else sent.checked()]
    with budget.holding(memory):
        return _decoded_tiles(image, data, policy, plan, fmt, turn, (width, height), index, documents, budget)


def _decoded_tiles(image: Image.Image, data: bytes, policy: Policy, plan: TilePlan, fmt: str, turn: int,
                   size: tuple[int, int], index: FingerprintIndex | None, documents: _Documents,
                   budget: DecodeBudget) -> list[NormalisedImage]:
    width, height = size
    if policy.output_format == "jpeg" and _downscales_whole(image, turn, plan):
        return [_downscaled(image, data, policy, (plan.width, plan.height), index=index, documents=documents,
                            budget=budget)]
    documents.refuse()
    try:
        image.seek(0)  # the first frame of an animation
        pixels, raw = _decode_scaled(image, data, fmt, turn, (plan.width, plan.height), budget)
        if pixels.size != (plan.width, plan.height):
            pixels = bicubic(pixels, (plan.width, plan.height), pixels=raw)
    except (CorruptImage, ImageTooComplex):
        raise
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
    except (RuntimeError, MemoryError, struct.error, IndexError, KeyError, TypeError) as exc:
        # Decoder libraries signal hostile input in their own ways (pillow-heif raises
        # RuntimeError on its security limits); all of it means the same to the caller.
        raise CorruptImage(f"image data could not be decoded: {exc}") from None
    tiles = [pixels] if len(plan.boxes) == 1 else [pixels.crop(box) for box in plan.boxes]
    return [
        _encode(tile, policy, fmt=fmt, source=(width, height), position=position, count=len(tiles),
                index=index)
        for position, tile in enumerate(tiles)
    ]


def _passes_through(image: Image.Image, fmt: str, turn: int, plan: TilePlan, size: tuple[int, int]) -> bool:
    """A JPEG photo the policy leaves as it is goes to the engine as it came, when the policy
    sends JPEG: decoding and re-encoding it would only cost time (and a generation of JPEG
    loss). Upright (the engine
    does not turn images by their EXIF orientation), RGB or grey (what the engine makes of
    other modes may differ from ours), one frame, within every bound of the policy."""
    return fmt == "JPEG" and _upright_jpeg_whole(image, turn, plan) and (plan.width, plan.height) == size


def _upright_jpeg_whole(image: Image.Image, turn: int, plan: TilePlan) -> bool:
    """A JPEG libjpeg-turbo decodes straight, upright, that the policy sends as one image."""
    return turbo_decodable(image) and turn == 1 and len(plan.boxes) == 1


def _as_sent(image: Image.Image, data: bytes, *, index: FingerprintIndex | None,
             documents: _Documents, budget: DecodeBudget) -> NormalisedImage:
    """The image as it came, its check still to be done (`checked()`): its search for an
    embedded document, then its decode."""
    width, height = image.size
    return NormalisedImage(
        source_format="JPEG", source_width=width, source_height=height, width=width, height=height,
        data=data, mime="image/jpeg", fingerprint="", check=functools.partial(_check_sent, data, image, index, documents, budget),
    )


def _check_sent(data: bytes, image: Image.Image, index: FingerprintIndex | None, documents: _Documents,
                budget: DecodeBudget) -> str:
    """An image sent as it came checked as the intake checks any other, and its fingerprint:
    every scan of the JPEG is decoded (truncated or corrupt data fails here as it would in a
    full decode), at a quarter of its size. Its fingerprint's bits are then within 4 of 63 of
    the full decode's, as at half size (a re-encoding's distance, well inside the index's 6;
    at an eighth, libjpeg's scaled decode moves them by up to 10: another picture). Decoded to
    grey, what the fingerprint is made of: libjpeg-turbo then transforms only the luma, for the
    same bits (a 1 MP photo: 1.75 ms, fingerprint included, where colour took 2.0 and colour at
    half size 2.7). A polyglot (`documents`, searched first) is refused as such, broken or not.
    Its CPU time is its request's (`budget`), wherever it runs."""
    with budget.timed():
        documents.refuse()
        small = as_image(decode_jpeg(data, image, 4, grey=True, max_scans=budget.limits.max_scans,
                                     cpu_seconds=budget.cpu_allowed()))  # CorruptImage for anything but a whole JPEG
        return fingerprint(small, index, size=image.size)


# Threads for the work of a picture that can run beside the rest of it (its re-encode, beside
# its fingerprint): one per core.
_helpers = Threads("imaging", CORES)


def _downscales_whole(image: Image.Image, turn: int, plan: TilePlan) -> bool:
    """An upright colour JPEG the policy brings down to one smaller image: the common large
    upload (a phone's photo), which `_downscaled` takes on every core at hand."""
    return (_upright_jpeg_whole(image, turn, plan) and image.mode == "RGB"
            and (plan.width, plan.height) != image.size and min(plan.width, plan.height) >= 2)


def _downscaled(image: Image.Image, data: bytes, policy: Policy, size: tuple[int, int], *,
                index: FingerprintIndex | None, documents: _Documents, budget: DecodeBudget) -> NormalisedImage:
    """The JPEG decoded at the DCT scale that covers `size`, resampled by libvips, re-encoded
    by libjpeg-turbo. Decoded at a reduced scale (the photo is at least four times the pixels
    it is brought to: its entropy decoding dominates) where the row-by-row decoder is built
    (rows.py), the resample and encode run on a helper thread behind the decode, a band at a
    time (a 12 MP photo: 35.5 ms in all against 40.6), while a core is free for them
    (rows.turn); otherwise the decode is whole,
    the resample on every core, and the encode on a helper thread while this one fingerprints.
    The pixels go from decoder to resampler to encoder as they are: the only Pillow image made
    is the fingerprint's. The same pixels, the same encoder settings (baseline, 4:2:0, the
    policy's quality) as the general path, which decodes and encodes through Pillow."""
    scale = _dct_scale(image.size, size)
    limits = {"max_scans": budget.limits.max_scans, "cpu_seconds": budget.cpu_allowed()}
    with rows.turn() as behind:  # counted while it decodes, whichever way
        streamed = scale > 1 and behind and rows.standard_sampling(image)
        if streamed:
            made = rows.downscale(data, scale, size, quality=policy.output_quality, helpers=_helpers(),
                                  beside=documents.found, **limits)
        else:
            documents.refuse()
            raw = decode_jpeg(data, image, scale, **limits)
    if streamed:
        documents.refuse()  # searched beside the decode: nothing is fingerprinted or sent before
        encoded, ident = made.jpeg, fingerprint_of_bits(narrowed_bits(made.narrow, size[1]), size, index)
    else:
        pixels = bicubic_rgb(raw, raw.shape[1], raw.shape[0], size)
        encoding = _helpers().submit(rows.encode, pixels, size, policy.output_quality)
        ident = fingerprint(Image.frombytes("RGB", size, pixels), index)
        encoded = encoding.result()
    return NormalisedImage(
        source_format="JPEG", source_width=image.width, source_height=image.height, width=size[0],
        height=size[1], data=encoded, mime=_MIME["jpeg"], fingerprint=ident,
    )


def normalise(data: bytes, policy: Policy, *, detail: str | None = None,
              index: FingerprintIndex | None = None) -> NormalisedImage:
    """Like `normalise_tiles` for callers that need exactly one image: long images are refused."""
    return normalise_tiles(data, replace(policy, tile_long_images=False), detail=detail, index=index)[0]


def _encode(image: Image.Image, policy: Policy, *, fmt: str, source: tuple[int, int], position: int,
            count: int, index: FingerprintIndex | None) -> NormalisedImage:
    out = io.BytesIO()
    kind = policy.output_format
    options = {"quality": policy.output_quality} if kind in ("jpeg", "webp") else {}
    image.save(out, format=kind.upper(), **options)
    return NormalisedImage(
        source_format=fmt, source_width=source[0], source_height=source[1],
        width=image.width, height=image.height, data=out.getvalue(), mime=_MIME[kind],
        fingerprint=fingerprint(image, index), tile=position, tiles=count,
    )
