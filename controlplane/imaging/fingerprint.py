"""A fingerprint of an image's normalised pixels that survives re-encoding.

The same picture sent again as a PNG instead of a JPEG, or re-saved at another quality, has
different bytes but the same content. `perceptual_bits` keeps the low frequencies of a 32x32
grey thumbnail (an 8x8 DCT block, as perceptual hashes do) and records which of the 63 AC
coefficients are above their median. Re-encoding noise lives in the high frequencies: across
PNG, JPEG q60-q95 and WebP re-encodings the bits differ in at most 4 places, while different
pictures differ in 20 or more (bench/imaging prints both distributions).

A bit whose coefficient sits on the median can still flip, so an exact hash of the bits
cannot be stable for every picture. `FingerprintIndex` closes that gap: it gives a picture
the fingerprint of the first near-identical picture it saw (same normalised size, at most
`max_distance` bits apart), found by pigeonhole lookup on bands of the bits.

Used for cache-hit metering and for cache-affinity routing (send a repeated image to the
engine that already encoded it). No Django, no Celery.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict

import numpy as np
from PIL import Image

_SIDE = 32
_LOW = 8
# cos((2x + 1) u pi / 2N) for the 8 lowest frequencies: the rows of a partial DCT-II matrix.
_COS = np.array([[math.cos((2 * x + 1) * u * math.pi / (2 * _SIDE)) for x in range(_SIDE)] for u in range(_LOW)])


def _low_frequencies(pixels: bytes) -> list[float]:
    """The separable DCT-II of the 32x32 grey thumbnail, keeping the 8 lowest frequencies in
    each direction (v major, as the bits are laid out)."""
    grid = np.frombuffer(pixels, dtype=np.uint8).reshape(_SIDE, _SIDE).astype(np.float64)
    return (_COS @ grid @ _COS.T).ravel().tolist()


def narrowed(grey: Image.Image) -> bytes:
    """The first of the thumbnail's two passes: each row of the grey picture `grey` brought
    to 32 columns. Row by row, so that a picture's can be made a band of rows at a time, while
    it is decoded (the bands' joined are the whole's)."""
    return grey.resize((_SIDE, grey.height), Image.Resampling.BOX).tobytes()


def narrowed_bits(rows: bytes, height: int) -> int:
    """The bits of a picture `height` rows high from its `narrowed` rows."""
    # The second pass. Two passes of Pillow's BOX resize, the rows first, where one call would
    # choose its own order (columns first for a tall picture), so that a band at a time
    # gives the same bits as the whole.
    thumbnail = Image.frombytes("L", (_SIDE, height), rows).resize((_SIDE, _SIDE), Image.Resampling.BOX)
    coefficients = _low_frequencies(thumbnail.tobytes())[1:]  # drop DC: overall brightness
    median = sorted(coefficients)[len(coefficients) // 2]
    bits = 0
    for value in coefficients:
        bits = (bits << 1) | (value > median)
    return bits


def perceptual_bits(image: Image.Image) -> int:
    grey = image.convert("L")
    return narrowed_bits(narrowed(grey), grey.height)


def _ident(width: int, height: int, bits: int) -> str:
    key = f"{width}x{height}:{bits:016x}".encode()
    return hashlib.blake2b(key, digest_size=16, person=b"vlm-image").hexdigest()


def fingerprint(image: Image.Image, index: FingerprintIndex | None = None, *,
                size: tuple[int, int] | None = None) -> str:
    """32 hex characters identifying the picture at its normalised size (`size`, when `image`
    is a smaller copy of it: the low frequencies the bits keep are the same)."""
    return fingerprint_of_bits(perceptual_bits(image), size or image.size, index)


def fingerprint_of_bits(bits: int, size: tuple[int, int], index: FingerprintIndex | ScopedIndex | None = None) -> str:
    """`fingerprint` of a picture of `size` whose `perceptual_bits` are `bits`."""
    if index is not None:
        return index.lookup(size[0], size[1], bits)
    return _ident(size[0], size[1], bits)


class FingerprintIndex:
    """Gives near-identical pictures (re-encodings of one image) one fingerprint.

    Bounded: the least recently seen pictures are forgotten past `max_items`.
    """

    BITS = _LOW * _LOW - 1

    def __init__(self, *, max_items: int = 50_000, max_distance: int = 6):
        self.max_items = max_items
        self.max_distance = max_distance
        self.bands = max_distance + 1  # two hashes within max_distance share at least one band
        self._band_width = math.ceil(self.BITS / self.bands)
        self._items: OrderedDict[tuple[str, str], tuple[int, int, int]] = OrderedDict()  # (scope, id) -> (w, h, bits)
        self._buckets: dict[tuple, set[str]] = {}
        self._lock = threading.Lock()  # the gateway normalises images on several threads

    def __len__(self) -> int:
        return len(self._items)

    def _keys(self, scope: str, width: int, height: int, bits: int):
        mask = (1 << self._band_width) - 1
        for band in range(self.bands):
            yield (scope, width, height, band, (bits >> (band * self._band_width)) & mask)

    def scoped(self, scope: str) -> ScopedIndex:
        """The index as one tenant sees it: a picture maps only to pictures that tenant sent
        (another tenant's re-encoding of it must not reveal that it was sent)."""
        return ScopedIndex(self, scope)

    def canonical(self, image: Image.Image, *, scope: str = "", size: tuple[int, int] | None = None) -> str:
        width, height = size or image.size
        return self.lookup(width, height, perceptual_bits(image), scope=scope)

    def touch(self, ident: str, *, scope: str = "") -> None:
        """A picture known as `ident` seen again, without its bits taken again: the last it is
        forgotten (nothing, if it has been already)."""
        with self._lock:
            if (scope, ident) in self._items:
                self._items.move_to_end((scope, ident))

    def lookup(self, width: int, height: int, bits: int, *, scope: str = "") -> str:
        with self._lock:
            return self._lookup(scope, width, height, bits)

    def _lookup(self, scope: str, width: int, height: int, bits: int) -> str:
        for key in self._keys(scope, width, height, bits):
            for known in self._buckets.get(key, ()):
                _, _, other = self._items[known]
                if bin(bits ^ other).count("1") <= self.max_distance:
                    self._items.move_to_end(known)
                    return known[1]
        entry = (scope, _ident(width, height, bits))
        self._items[entry] = (width, height, bits)
        for key in self._keys(scope, width, height, bits):
            self._buckets.setdefault(key, set()).add(entry)
        while len(self._items) > self.max_items:
            old, (w, h, b) = self._items.popitem(last=False)
            for key in self._keys(old[0], w, h, b):
                self._buckets[key].discard(old)
                if not self._buckets[key]:
                    del self._buckets[key]
        return entry[1]


class ScopedIndex:
    def __init__(self, index: FingerprintIndex, scope: str):
        self.index, self.scope = index, scope

    def lookup(self, width: int, height: int, bits: int) -> str:
        return self.index.lookup(width, height, bits, scope=self.scope)
