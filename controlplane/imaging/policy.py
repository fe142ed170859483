"""Resolution policy: decode safely, orient, flatten, downscale, re-encode."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from controlplane.imaging.errors import (
    CorruptImage,
    ImageTooLarge,
    InvalidDataURL,
    PolicyViolation,
    UnsupportedFormat,
)

try:  # HEIC/HEIF and AVIF through libheif
    import pillow_heif

    pillow_heif.register_heif_opener()
except ImportError:  # pragma: no cover - pinned dependency, but decoding others still works
    pillow_heif = None

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "HEIF", "AVIF")
_MIME = {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp"}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,")


@dataclass(frozen=True)
class Policy:
    min_pixels: int = 3136
    max_pixels: int = 1003520
    low_detail_max_pixels: int = 200704
    default_detail: str = "high"
    max_long_edge: int = 4096
    max_aspect_ratio: float = 20.0
    tile_long_images: bool = True
    max_images_per_request: int = 4
    max_total_pixels: int = 16_000_000
    max_input_pixels: int = 50_000_000
    allowed_formats: tuple[str, ...] = ()
    output_format: str = "jpeg"
    output_quality: int = 90

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

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


def decode_data_url(url: str, *, max_bytes: int) -> bytes:
    match = _DATA_URL.match(url[:256])
    if match is None:
        raise InvalidDataURL("image_url must be a data: URL (data:image/...;base64,...)")
    if not match.group("b64"):
        raise InvalidDataURL("image data URLs must be base64 encoded (;base64,)")
    payload = url[match.end():]
    if (len(payload) * 3 // 4) - (len(payload) - len(payload.rstrip("="))) > max_bytes:
        raise ImageTooLarge(f"image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidDataURL("image data URL is not valid base64") from None
    if not data:
        raise CorruptImage("image data is empty")
    return data


def fit_within(width: int, height: int, *, max_pixels: int, max_long_edge: int) -> tuple[int, int]:
    """The largest size with the same aspect ratio inside both bounds; never upscales."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)), max_long_edge / max(width, height))
    if scale >= 1.0:
        return width, height
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _open(data: bytes, policy: Policy) -> Image.Image:
    if not data:
        raise CorruptImage("image data is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooLarge("image has more pixels than allowed") from None
    except UnidentifiedImageError:
        raise UnsupportedFormat(
            "image format not recognised (supported: " + ", ".join(SUPPORTED_FORMATS) + ")"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise CorruptImage(f"image could not be read: {exc}") from None
    fmt = (image.format or "").upper()
    if fmt == "MPO":  # multi-picture JPEG from cameras; the first picture is a JPEG
        fmt = "JPEG"
    if fmt not in SUPPORTED_FORMATS:
        raise UnsupportedFormat(f"image format {fmt or 'unknown'} is not supported")
    if policy.allowed_formats and fmt not in policy.allowed_formats:
        raise UnsupportedFormat(
            f"image format {fmt} is not allowed here (allowed: {', '.join(policy.allowed_formats)})"
        )
    width, height = image.size
    if width <= 0 or height <= 0:
        raise CorruptImage("image has no pixels")
    if width * height > policy.max_input_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} ({width * height} pixels); at most "
            f"{policy.max_input_pixels} pixels are accepted"
        )
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda v: v / 256).convert("L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "RGBa"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def normalise(data: bytes, policy: Policy, *, detail: str | None = None) -> NormalisedImage:
    """Decode `data` safely and bring it within `policy`, ready to send to the engine."""
    cap = policy.pixel_cap(detail)
    image = _open(data, policy)
    source_format = "JPEG" if image.format == "MPO" else image.format
    try:
        stored_w, stored_h = image.size
        orientation = image.getexif().get(0x0112, 1)
        swapped = orientation in (5, 6, 7, 8)
        width, height = (stored_h, stored_w) if swapped else (stored_w, stored_h)
        ratio = max(width, height) / min(width, height)
        if ratio > policy.max_aspect_ratio:
            raise PolicyViolation(
                f"image aspect ratio {ratio:.1f} exceeds the policy's {policy.max_aspect_ratio:g}"
            )
        target_w, target_h = fit_within(
            width, height, max_pixels=cap, max_long_edge=policy.max_long_edge
        )
        if source_format == "JPEG" and (target_w, target_h) != (width, height):
            # DCT-domain downscale: decode at 1/2, 1/4 or 1/8 size when that still covers the target.
            draft = (target_h, target_w) if swapped else (target_w, target_h)
            image.draft("RGB", draft)
        image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
        image = _to_rgb(image)
        if image.size != (target_w, target_h):
            image = image.resize((target_w, target_h), Image.Resampling.LANCZOS, reducing_gap=2.0)
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        if isinstance(exc, PolicyViolation):
            raise
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
    fingerprint = hashlib.blake2b(
        image.tobytes(), digest_size=16, person=b"vlm-pixels"
    ).hexdigest()
    out = io.BytesIO()
    fmt = policy.output_format
    save_args = {"quality": policy.output_quality} if fmt in ("jpeg", "webp") else {}
    image.save(out, format=fmt.upper(), **save_args)
    return NormalisedImage(
        source_format=source_format,
        source_width=width,
        source_height=height,
        width=image.width,
        height=image.height,
        data=out.getvalue(),
        mime=_MIME[fmt],
        fingerprint=fingerprint,
    )
