"""Opening untrusted image bytes safely.

The format comes from the bytes (Pillow's signature checks), never from a file name, a MIME
type or a header. Only the formats a policy allows are even tried, the pixel count is read
from the header and checked before any pixel is decoded, and the bytes are searched for the
payloads polyglot files smuggle (HTML, script, PHP, PDF, ZIP).
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass

import simplejpeg
from PIL import Image, UnidentifiedImageError

from controlplane.imaging import rows
from controlplane.imaging.budget import DEFAULT_MAX_SCANS, CpuDeadline
from controlplane.imaging.errors import (
    CorruptImage,
    ImageTooComplex,
    ImageTooLarge,
    UnsupportedFormat,
)

try:  # HEIC/HEIF through libheif; AVIF is native in Pillow 11.3+
    import pillow_heif

    pillow_heif.register_heif_opener()
except ImportError:  # pragma: no cover - a pinned dependency
    pillow_heif = None

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "HEIF", "AVIF")
_PLUGINS = {"JPEG": ("JPEG", "MPO"), "TIFF": ("TIFF",), "HEIF": ("HEIF",)}
_SVG = re.compile(rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*(<!doctype svg|<svg)", re.I | re.S)
# Six or more distinctive bytes each, so that compressed pixel data matches by chance
# with negligible probability.
_PAYLOAD = re.compile(rb"<(script|html|\?php|iframe|object)[\s>]|%PDF-\d\.\d", re.I)
_ZIP_DIRECTORY_END = b"PK\x05\x06"
_SCAN_WINDOW = 256 * 1024


class PolyglotImage(CorruptImage):
    code = "polyglot_image"


def _plugins(allowed: tuple[str, ...]) -> tuple[str, ...]:
    Image.init()
    names = []
    for fmt in allowed or SUPPORTED_FORMATS:
        names += [name for name in _PLUGINS.get(fmt, (fmt,)) if name in Image.OPEN]
    return tuple(names)


# The same search in two parts, each with a literal first byte, run on the lowered bytes (the
# bytes patterns ignore case as bytes.lower() does: ASCII only): the regex engine scans for a
# literal first byte in C, where an alternation of two first bytes, or re.I, makes it try
# every position (0.7 ms on a 256 KB window against 0.16 for both).
_TAG = re.compile(rb"<(?:script|html|\?php|iframe|object)[\s>]")
_PDF = re.compile(rb"%pdf-\d\.\d")


def _payload(region: bytes):
    """The first payload in `region`, as `_PAYLOAD.search` finds it."""
    lowered = region.lower()
    starts = [found.start() for found in (_TAG.search(lowered), _PDF.search(lowered)) if found is not None]
    return _PAYLOAD.match(region, min(starts)) if starts else None


def sniff_problem(data: bytes, *, documents: bool = True) -> None:
    """Refuse what is not a raster image before Pillow looks at it, and (unless not
    `documents`: the caller searches for them itself) a polyglot."""
    if not data:
        raise CorruptImage("image data is empty (zero bytes)")
    if _SVG.match(data[:4096]):
        raise UnsupportedFormat("SVG (vector) images are not supported; send a raster image "
                                "such as PNG or JPEG")
    if documents and (found := embedded_document(data)) is not None:
        raise found


def embedded_document(data: bytes) -> PolyglotImage | None:
    """The refusal of image data that carries a document other parsers would read, or None."""
    # Polyglots put their document where other parsers look: at the start, in metadata
    # near the start, or appended after the image. (Anything hidden inside the pixel data
    # is discarded when the image is re-encoded.) Scanning the head and the tail keeps
    # this cheap on large files.
    window = _SCAN_WINDOW
    regions = (data,) if len(data) <= 2 * window else (data[:window], data[-window:])
    payload = next((m for m in map(_payload, regions) if m is not None), None)
    if payload is not None:
        return PolyglotImage(f"image data carries an embedded {payload.group(0)[:8]!r}… document; "
                             "polyglot files are refused")
    if _ZIP_DIRECTORY_END in data[-65_557:]:
        return PolyglotImage("image data carries an embedded ZIP archive; polyglot files are refused")
    return None


def open_image(data: bytes, *, allowed_formats: tuple[str, ...], max_input_pixels: int,
               max_scans: int = DEFAULT_MAX_SCANS, cpu_seconds: float | None = None,
               sniffed: bool = False) -> Image.Image:
    """Open `data` lazily (header only) and check its format, its pixel count and, for a JPEG,
    its scans, after `sniff_problem` (unless `sniffed`: the caller has refused what is not a
    raster image, and searches for documents itself). With `cpu_seconds`, Pillow's decode of
    it, on this thread, stops past that much CPU time (ImageTooComplex)."""
    if not sniffed:
        sniff_problem(data)
    try:
        with warnings.catch_warnings():
            # Our own cap below decides; Pillow's bomb warning would only add noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            source = io.BytesIO(data) if cpu_seconds is None else CpuDeadline(data, cpu_seconds)
            image = Image.open(source, formats=_plugins(allowed_formats))
    except Image.DecompressionBombError:
        raise ImageTooLarge("image has more pixels than allowed") from None
    except ImageTooComplex:  # its CPU time ran out while its header was read
        raise
    except UnidentifiedImageError:
        if allowed_formats:
            try:
                detected = Image.open(io.BytesIO(data)).format
            except Exception:  # noqa: BLE001 - any failure means "not an image we know"
                detected = None
            if detected:
                raise UnsupportedFormat(
                    f"image format {detected} is not allowed here "
                    f"(allowed: {', '.join(allowed_formats)})") from None
        raise UnsupportedFormat(
            "image format not recognised (supported: " + ", ".join(SUPPORTED_FORMATS) + ")"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, RuntimeError, struct.error, IndexError,
            KeyError, TypeError) as exc:
        raise CorruptImage(f"image header could not be read: {exc}") from None
    if image.format in ("JPEG", "MPO"):
        layout = jpeg_layout(data, scan_limit=max_scans)
        if layout.frame not in _DCT_FRAMES:
            # Lossless and hierarchical JPEG: no DCT to scale, and libjpeg-turbo's scaled decode
            # of a lossless one brought the process down.
            raise UnsupportedFormat("lossless and hierarchical JPEGs are not supported; send a baseline or "
                                    "progressive JPEG, or a PNG")
        if layout.scans > max_scans:
            raise ImageTooComplex(f"image is a JPEG of more than {max_scans} scans; at most {max_scans} are "
                                  "accepted (save it as a baseline JPEG)")
    # For a GIF this is the canvas: a tiny frame on a huge canvas is still a huge image.
    check_input_size(*image.size, max_input_pixels)
    if cpu_seconds is not None:
        # Blocks of 4 KB (of Pillow's 64) between checks of the deadline: a PNG inflates up
        # to a thousandfold, so one block can hold a whole picture's rows. No slower.
        image.decodermaxblock = 4096
    return image


# Start-of-frame markers of the DCT processes: baseline, extended, progressive (Huffman), and
# extended and progressive (arithmetic).
_DCT_FRAMES = {0xC0, 0xC1, 0xC2, 0xC9, 0xCA}
_PROGRESSIVE = {0xC2, 0xCA}
_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# Where a scan's entropy-coded data ends: a marker (0xFF then anything but a stuffed zero or a
# restart marker), found by the regex engine in C however long the data.
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7]")


@dataclass(frozen=True)
class JpegLayout:
    """What a JPEG's markers say before any of it is decoded."""

    frame: int | None  # its start-of-frame marker (coding process), None if none was found
    scans: int  # its scans, counted up to one past the limit it was read with

    @property
    def progressive(self) -> bool:
        return self.frame in _PROGRESSIVE


def jpeg_layout(data: bytes, *, scan_limit: int) -> JpegLayout:
    """The JPEG's coding process and number of scans, read from its markers alone.

    Each scan of a progressive JPEG is a full pass of the decoder over every block, so a file
    of a few hundred kilobytes can hold thousands of them (a scan of nothing but end-of-block
    runs is a few bytes): the scans are counted before anything is decoded. A scan's data is
    skipped by a search for the next marker, in C; a baseline JPEG whose first scan holds every
    component has no other (libjpeg refuses one), so its data is never searched."""
    frame, components, scans, at = None, 0, 0, 2
    while at + 4 <= len(data) and scans <= scan_limit:
        if data[at] != 0xFF:
            break  # not a marker where one must be: the decoder will say what is wrong
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            at += 2
            continue
        if marker == 0xD9:
            break
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if marker in _FRAMES and frame is None:
            frame, components = marker, data[at + 9] if at + 9 < len(data) else 0
        elif marker == 0xDA:
            scans += 1
            whole = frame not in _PROGRESSIVE and at + 4 < len(data) and data[at + 4] == components
            if whole and scans == 1:
                break
            end = _SCAN_END.search(data, at + 2 + length)
            if end is None:
                break
            at = end.start()
            continue
        at += 2 + length
    return JpegLayout(frame, scans)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Ancillary PNG chunks that change what Pillow decodes: transparency, orientation, animation.
# Every other ancillary chunk (text, time, colour notes Pillow does not apply, private ones)
# is metadata.
_PNG_PIXEL_CHUNKS = {b"tRNS", b"eXIf", b"acTL", b"fcTL", b"fdAT"}
_PNG_MAX_CHUNKS = 4096  # more, and the bytes are taken whole (walking them costs the event loop)
# JPEG segments that change what libjpeg decodes among the application ones: APP1 (EXIF,
# whose orientation turns the picture) and APP14 (Adobe's colour transform). The others (JFIF,
# ICC, Photoshop's, ...) and comments are metadata.
_JPEG_PIXEL_APPS = {0xE1, 0xEE}


def pixel_content(data: bytes) -> list[memoryview]:
    """The parts of a PNG's or a JPEG's bytes that decide its pixels, in order: the picture
    without the metadata no decoder turns into pixels (its text, comments, colour profiles).
    Two files that differ in metadata alone have the same. Other formats, or a file that does
    not walk as its format should: the bytes whole."""
    view = memoryview(data)
    if data.startswith(_PNG_SIGNATURE):
        kept, at = [view[:8]], 8
        for _ in range(_PNG_MAX_CHUNKS):
            if at + 12 > len(data):
                return [view]
            length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
            end = at + 12 + length
            if kind[:1].isupper() or kind in _PNG_PIXEL_CHUNKS:
                kept.append(view[at:end])
            if kind == b"IEND":
                return kept
            at = end
        return [view]
    if data.startswith(b"\xff\xd8"):
        kept, at = [view[:2]], 2
        while at + 4 <= len(data) and data[at] == 0xFF:
            marker = data[at + 1]
            if marker == 0xDA:  # the scans, to the end
                kept.append(view[at:])
                return kept
            if marker in (0xFF, 0x01) or 0xD0 <= marker <= 0xD8:
                return [view]  # fill bytes or a marker with no length before the scans: take it whole
            end = at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
            if not (0xE0 <= marker <= 0xEF and marker not in _JPEG_PIXEL_APPS or marker == 0xFE):
                kept.append(view[at:end])
            at = end
    return [view]


def check_input_size(width: int, height: int, max_input_pixels: int) -> None:
    """Refuse a picture with no pixels, or with more than the intake decodes."""
    if width <= 0 or height <= 0:
        raise CorruptImage("image has no pixels")
    if width * height > max_input_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} ({width * height:,} pixels); at most "
            f"{max_input_pixels:,} pixels are accepted")


def source_format(image: Image.Image) -> str:
    return "JPEG" if image.format == "MPO" else (image.format or "UNKNOWN")


def orientation(image: Image.Image) -> int:
    """The picture's EXIF orientation (1..8), from its header alone."""
    try:
        if image.format == "PNG":
            # Pillow looks for a PNG's eXIf chunk past its pixel data by decoding them all:
            # only one before the pixels counts, where the PNG specification puts it.
            exif = Image.Exif()
            if image.info.get("exif"):
                exif.load(image.info["exif"])
        else:
            exif = image.getexif()
        value = exif.get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is as good as none
        return 1
    return value if value in range(1, 9) else 1


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB whatever the mode: 16-bit scaled down, palette expanded, alpha composited on white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        image = image.convert("I")
    if image.mode == "I":
        image = image.point(lambda v: v * (1 / 256)).convert("L")
    if image.mode == "F":
        image = image.convert("L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode == "1":
        image = image.convert("L")
    return image.convert("RGB")


_TURNS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
          8: Image.Transpose.ROTATE_90}


def upright(image: Image.Image, turn: int) -> Image.Image:
    """Apply an EXIF orientation (1..8) to decoded pixels (which may carry no EXIF of their own)."""
    return image.transpose(_TURNS[turn]) if turn in _TURNS else image


def turbo_decodable(image: Image.Image) -> bool:
    """A JPEG libjpeg-turbo decodes straight to RGB or grey (YCbCr, RGB or grey; not CMYK, not
    a multi-picture file)."""
    return image.format == "JPEG" and image.mode in ("RGB", "L")


def decode_jpeg(data: bytes, image: Image.Image, scale: int, *, grey: bool = False,
                max_scans: int = DEFAULT_MAX_SCANS, cpu_seconds: float = 0):
    """The JPEG `image` (opened from `data`) decoded at 1/`scale` (1, 2, 4 or 8) in the DCT
    domain by libjpeg-turbo, strictly: truncated or corrupt data is refused, as a full decode
    would refuse it. A few milliseconds faster than Pillow's decode of the same scale. The
    pixels as the decoder wrote them: a numpy array, rows of RGB (or grey, for a grey JPEG, or
    when `grey`: only the luma is transformed, every scan still decoded). Where the row decoder
    is built, stopped past `max_scans` scans or `cpu_seconds` of this thread's CPU time
    (ImageTooComplex); elsewhere only the scans counted in its header bound it."""
    if rows.compiled():
        return rows.decode_whole(data, scale, grey=grey or image.mode == "L", max_scans=max_scans,
                                 cpu_seconds=cpu_seconds)
    width, height = image.size
    try:
        return simplejpeg.decode_jpeg(data, colorspace="GRAY" if grey or image.mode == "L" else "RGB", strict=True,
                                      min_width=-(-width // scale), min_height=-(-height // scale))
    except ValueError as exc:
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None


def as_image(pixels) -> Image.Image:
    """Decoded pixels (rows of RGB, or of grey) as a Pillow image sharing their memory."""
    rows, columns = pixels.shape[:2]
    mode = "L" if pixels.ndim == 2 or pixels.shape[2] == 1 else "RGB"
    return Image.frombuffer(mode, (columns, rows), pixels, "raw", mode, 0, 1)
