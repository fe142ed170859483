"""Bad and awkward image inputs, generated here (nothing is downloaded).

Each case: name -> (bytes, expected), where expected is an error code the image library must
raise, or ("ok", width, height) for an image it must accept at that upright size.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

# How pillow's exif_transpose undoes each orientation; the stored image is the inverse.
_STORE = {1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
          4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
          7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


def _save(image, fmt, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_with_header(width: int, height: int, *, rows_of_zeros: bool) -> bytes:
    """A PNG whose header claims width x height; its pixels are zeros (a bomb's payload)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    compressor = zlib.compressobj(9)
    if rows_of_zeros:
        row = b"\0" * (1 + width * 3)
        payload = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    else:
        payload = compressor.compress(b"\0" * 1000) + compressor.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", payload)
            + _chunk(b"IEND", b""))


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says `width` x `height` and whose pixel data is garbage: decoding
    it fails, so a refusal for its size shows that nothing was decoded."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", b"not zlib") + _chunk(b"IEND", b"")


def zeros_png(width: int, height: int) -> bytes:
    """A valid PNG of black rows: a few kilobytes that decode to width x height pixels."""
    return png_with_header(width, height, rows_of_zeros=True)


def gif_canvas_bomb(side: int = 40_000) -> bytes:
    """A logical screen of side x side holding one 1x1 frame."""
    screen = b"GIF89a" + struct.pack("<HHBBB", side, side, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return screen + frame + b"\x3b"


def many_frames_gif(frames: int = 10_000) -> bytes:
    first = Image.new("P", (32, 32), 1)
    rest = [Image.new("P", (32, 32), i % 200) for i in range(frames - 1)]
    return _save(first, "GIF", save_all=True, append_images=rest, duration=10, loop=0)


def oriented(orientation: int) -> bytes:
    """An upright 300x200 picture, red at the top left, stored with an EXIF orientation."""
    upright = Image.new("RGB", (300, 200), (20, 20, 200))
    upright.paste((230, 20, 20), (0, 0, 60, 40))
    stored = upright if _STORE[orientation] is None else upright.transpose(_STORE[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(stored, "JPEG", quality=95, exif=exif.tobytes())


def text_bomb_png(*, before_pixels: bool) -> bytes:
    """A compressed text chunk that inflates to 50 MB, before or after the pixel data."""
    base = _save(Image.new("RGB", (8, 8)), "PNG")
    bomb = _chunk(b"zTXt", b"k\0\0" + zlib.compress(b"A" * 50_000_000, 9))
    header_end = 8 + 25  # signature + IHDR chunk
    if before_pixels:
        return base[:header_end] + bomb + base[header_end:]
    return base[:-12] + bomb + base[-12:]


def chunky_png(chunks: int = 400_000) -> bytes:
    """An 8 x 8 PNG with `chunks` empty private chunks before its pixels: its header takes
    Pillow a second or more to walk."""
    base = _save(Image.new("RGB", (8, 8)), "PNG")
    header_end = 8 + 25  # signature + IHDR chunk
    return base[:header_end] + _chunk(b"prVt", b"") * chunks + base[header_end:]


def corpus() -> dict[str, tuple[bytes, object]]:
    jpeg = _save(Image.new("RGB", (640, 480), (200, 100, 50)), "JPEG", quality=90)
    png = _save(Image.new("RGB", (640, 480), (200, 100, 50)), "PNG")
    transparent = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    transparent.paste((0, 0, 255, 255), (0, 0, 32, 64))
    cases = {
        "zero-length": (b"", "corrupt_image"),
        "truncated-jpeg": (jpeg[: len(jpeg) * 6 // 10], "corrupt_image"),
        "truncated-png": (png[: len(png) // 2], "corrupt_image"),
        "garbage": (bytes(range(256)) * 40, "unsupported_image_format"),
        "png-bomb-400mp-header": (png_with_header(20_000, 20_000, rows_of_zeros=False), "image_too_large"),
        "png-150mp": (png_with_header(15_000, 10_000, rows_of_zeros=True), "image_too_large"),
        "gif-canvas-bomb": (gif_canvas_bomb(), "image_too_large"),
        "gif-10000-frames": (many_frames_gif(), ("ok", 32, 32)),
        "png-text-bomb-before-pixels": (text_bomb_png(before_pixels=True), "corrupt_image"),
        "png-text-bomb-after-pixels": (text_bomb_png(before_pixels=False), "corrupt_image"),
        "svg": (b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>',
                "unsupported_image_format"),
        "polyglot-jpeg-html": (jpeg + b"<html><script>alert(document.cookie)</script></html>", "polyglot_image"),
        "polyglot-gif-js": (b"GIF89a/*\x01\x00\x01\x00\x00\x00\x00*/=alert(1)//;", "unsupported_image_format"),
        "wrong-extension-png-as-jpg": (png, ("ok", 640, 480)),
        "cmyk-jpeg": (_save(Image.new("CMYK", (120, 80), (255, 0, 0, 0)), "JPEG"), ("ok", 120, 80)),
        "png-16-bit": (_save(Image.new("I;16", (90, 60), 40_000), "PNG"), ("ok", 90, 60)),
        "palette-gif": (_save(Image.new("P", (50, 40), 3), "GIF"), ("ok", 50, 40)),
        "transparent-png": (_save(transparent, "PNG"), ("ok", 64, 64)),
        "bmp": (_save(Image.new("RGB", (70, 50)), "BMP"), ("ok", 70, 50)),
        "tiff-two-pages": (_save(Image.new("RGB", (80, 60)), "TIFF", save_all=True,
                                 append_images=[Image.new("RGB", (8000, 6000))]), ("ok", 80, 60)),
        "webp": (_save(Image.new("RGB", (100, 75)), "WEBP"), ("ok", 100, 75)),
    }
    for n in range(1, 9):
        cases[f"exif-orientation-{n}"] = (oriented(n), ("ok", 300, 200))
    return cases


class _Bits:
    """Entropy-coded bits, MSB first, with JPEG's byte stuffing and 1-padding."""

    def __init__(self):
        self.out, self.acc, self.n = bytearray(), 0, 0

    def put(self, value: int, length: int) -> None:
        for i in range(length - 1, -1, -1):
            self.acc = (self.acc << 1) | ((value >> i) & 1)
            self.n += 1
            if self.n == 8:
                self.out.append(self.acc)
                if self.acc == 0xFF:
                    self.out.append(0)
                self.acc, self.n = 0, 0

    def done(self) -> bytes:
        if self.n:
            self.put((1 << (8 - self.n)) - 1, 8 - self.n)
        return bytes(self.out)


def _segment(marker: int, body: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(body) + 2) + body


def jpeg_scan_bomb(width: int, height: int, scans: int, *, colour: bool = False) -> bytes:
    """A valid progressive JPEG of `width` x `height` whose luma has `scans` AC scans, each
    nothing but end-of-block runs: libjpeg reads every one without a warning, each a pass over
    every block, so the decode's cost grows with the scans while the file stays small."""
    components = 3 if colour else 1
    blocks = -(-width // 8) * -(-height // 8)
    # One DC symbol (difference 0) coded "0"; AC symbols EOB0..EOB14 coded in 4 bits each.
    dc_table = b"\x00" + bytes([1] + [0] * 15) + b"\x00"
    ac_table = b"\x10" + bytes([0, 0, 0, 15] + [0] * 12) + bytes(n << 4 for n in range(15))
    head = b"\xff\xd8" + _segment(0xDB, b"\x00" + bytes([1] * 64))
    head += _segment(0xC2, struct.pack(">BHHB", 8, height, width, components)
                     + b"".join(bytes((c + 1, 0x11, 0)) for c in range(components)))
    head += _segment(0xC4, dc_table + ac_table)
    dc = _Bits()
    for _ in range(blocks * components):
        dc.put(0, 1)
    body = head + _segment(0xDA, bytes([components]) + b"".join(bytes((c + 1, 0x00)) for c in range(components))
                           + b"\x00\x00\x00") + dc.done()

    def ac_scan(component: int) -> bytes:
        bits, left = _Bits(), blocks
        while left:
            n = min(14, left.bit_length() - 1)
            run = min(left, (2 << n) - 1)
            bits.put(n, 4)
            bits.put(run - (1 << n), n)
            left -= run
        return _segment(0xDA, bytes((1, component, 0x00, 1, 63, 0x00))) + bits.done()

    for component in range(2, components + 1):
        body += ac_scan(component)
    body += b"".join(ac_scan(1) for _ in range(scans))
    return body + b"\xff\xd9"
