"""A large JPEG brought down with its resample and encode running behind its decode.

Decoding a 12 MP photo at half its size takes about 25 ms, most of it entropy decoding, which
runs on one core and which no DCT scale avoids: it is the floor. Decoding whole pictures
(simplejpeg), the resample (about 6 ms) and the encode (about 3) could only start once it
ended. Here the decoder (`_jpegrows`, libjpeg's scanline API) hands over a band of rows at a
time; a helper thread resamples (`resample.Bands`) and encodes each band of the result as soon
as the rows under it are in, on the other core, so little is left once the last row is
decoded. The same decoder, the same resample (to the bit on common sizes), the same encoder as the
whole-picture way.

`_jpegrows` is compiled where libjpeg's headers are installed (setup.py); without it, or in a
process where libvips cannot run, `streams()` is False and the caller decodes whole pictures.
Pure Python over C libraries: no Django, no Celery.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image

from controlplane.imaging.errors import CorruptImage, ImageTooComplex
from controlplane.imaging.fingerprint import narrowed
from controlplane.imaging.resample import Bands, vips_usable

try:
    from controlplane.imaging import _jpegrows
except ImportError:  # not compiled here: no libjpeg headers at install time
    _jpegrows = None

# Decoded rows handed over at a time: 64 rows of a 12 MP photo at half size are about 1 ms of
# decoding, so the resample follows closely, at a few dozen hand-overs a picture.
BAND = 64
# The result is taken in bands of at least 1/OUT_BANDS of its rows, the last one whatever is
# left once the decode ends. A band is one fetch from a region of the resample (a 12 MP photo's
# result in 24 bands took 9.7 ms of one core, where the whole at once took 11.4), so bands can
# be small and the last one short.
OUT_BANDS = 24
# The last FINAL rows are decoded FINAL_STEP at a time and their bands taken however small,
# so that less is left to resample and encode once the decode ends (1.5 ms left after a
# 12 MP photo's last rows with 64-row steps to the end; 1.2 this way).
FINAL, FINAL_STEP = 128, 16


def _decoder(data: bytes, scale: int, *, grey: bool = False, max_scans: int = 0, cpu_seconds: float = 0):
    try:
        return _jpegrows.Decoder(data, scale, grey, max_scans=max_scans, cpu_seconds=cpu_seconds)
    except ValueError as exc:
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
    except _jpegrows.TooCostly as exc:
        raise _too_costly(exc) from None


def _too_costly(exc: Exception) -> ImageTooComplex:
    return ImageTooComplex(f"image could not be decoded within its budget: {exc}")


def decode_whole(data: bytes, scale: int, *, grey: bool = False, max_scans: int = 0,
                 cpu_seconds: float = 0) -> np.ndarray:
    """The JPEG `data` decoded at 1/`scale`, rows of RGB (or grey, when `grey` or the JPEG is),
    as simplejpeg decodes it (the same pixels, in the same time), strictly; stopped past
    `max_scans` scans or `cpu_seconds` of this thread's CPU time (ImageTooComplex; 0: none)."""
    decoder = _decoder(data, scale, grey=grey, max_scans=max_scans, cpu_seconds=cpu_seconds)
    pixels = np.empty((decoder.height, decoder.width, decoder.channels), np.uint8)
    try:
        decoder.read(pixels)
        decoder.finish()
    except ValueError as exc:
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
    except _jpegrows.TooCostly as exc:
        raise _too_costly(exc) from None
    return pixels


def compiled() -> bool:
    """Whether the row-by-row decoder and encoder were built in this installation."""
    return _jpegrows is not None


def streams() -> bool:
    """Whether a downscale can run its resample and encode behind its decode here: the row
    decoder is built, libvips can run in this process, and there is a core besides the
    decode's for them."""
    return _jpegrows is not None and vips_usable() and _cores() > 1


def _cores() -> int:
    """The cores this process may run on now (it may have been pinned since it started)."""
    return len(os.sched_getaffinity(0))


_running = 0
_lock = threading.Lock()


@contextlib.contextmanager
def turn() -> Iterator[bool]:
    """A downscale's turn: whether it may run its resample and encode behind its decode. Only
    while it has a core to itself besides the decode's (no more downscales running in this
    process than cores less one): where every core is busy, bands cost more CPU than a whole
    resample (libvips sets up its pipeline for each) and would only take turns with the
    decodes."""
    global _running
    with _lock:
        free = _running < _cores() - 1
        _running += 1
    try:
        yield free and streams()
    finally:
        with _lock:
            _running -= 1


class _Progress:
    """Rows decoded so far, from the decoding thread to the one resampling behind it."""

    def __init__(self):
        self._changed = threading.Condition()
        self.decoded = 0
        self.abandoned = False

    def reached(self, rows: int) -> None:
        with self._changed:
            self.decoded = rows
            self._changed.notify()

    def abandon(self) -> None:
        with self._changed:
            self.abandoned = True
            self._changed.notify()

    def beyond(self, rows: int) -> int:
        """Once more than `rows` are decoded, how many (0 once the decode is abandoned)."""
        with self._changed:
            self._changed.wait_for(lambda: self.decoded > rows or self.abandoned)
            return 0 if self.abandoned else self.decoded


@dataclass(frozen=True)
class Downscaled:
    jpeg: bytes
    rgb: bytearray  # the resampled picture's rows
    narrow: bytearray  # its grey's fingerprint.narrowed rows (the thumbnail's first pass)


def downscale(data: bytes, scale: int, size: tuple[int, int], *, quality: int, helpers: Executor,
              beside: Callable[[], object] | None = None, max_scans: int = 0,
              cpu_seconds: float = 0) -> Downscaled | None:
    """The colour JPEG `data` decoded at 1/`scale`, resampled to `size` and encoded as a
    baseline 4:2:0 JPEG at `quality`: the JPEG, the resampled picture's RGB rows, and the
    first pass of its fingerprint's thumbnail (each band's, as it is made, so that only a pass
    over 32 columns is left once the decode ends: the thumbnail of the whole took about 1 ms
    after it, and turning the whole grey 0.5). CorruptImage for truncated or corrupt data
    (any warning of libjpeg's), as a whole decode refuses it. The decode runs on this thread;
    the rest on one of `helpers`, behind it, after `beside()`: work of the caller's that need
    not wait for the decode (a failed decode may leave it running, or never started; if it
    raises, the caller must run it again). When it returns anything but None (a refusal), the
    decode stops where it is and this returns None. The decode stops past `max_scans` scans or
    `cpu_seconds` of this thread's CPU time (ImageTooComplex; 0: no limit)."""
    decoder = _decoder(data, scale, max_scans=max_scans, cpu_seconds=cpu_seconds)
    if decoder.channels != 3:
        raise ValueError("downscale() takes colour JPEGs")
    # Zeroed (pages the decoder touches first; calloc'd, so nothing is written twice): a band
    # resampled too early would read black, never another request's pixels.
    source = np.zeros((decoder.height, decoder.width, 3), np.uint8)
    progress = _Progress()
    behind = helpers.submit(_resample_and_encode, source, size, quality, progress, beside)
    try:
        decoded = 0
        while decoded < decoder.height and not progress.abandoned:
            step = BAND if decoder.height - decoded > FINAL else FINAL_STEP
            decoded += decoder.read(source[decoded:decoded + step])
            progress.reached(decoded)
        if not progress.abandoned:
            decoder.finish()
    except ValueError as exc:
        progress.abandon()
        raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
    except _jpegrows.TooCostly as exc:
        progress.abandon()
        raise _too_costly(exc) from None
    except BaseException:
        progress.abandon()
        raise
    return behind.result()


def _resample_and_encode(source: np.ndarray, size: tuple[int, int], quality: int,
                         progress: _Progress, beside: Callable[[], object] | None) -> Downscaled | None:
    if beside is not None:
        try:
            refused = beside()  # while the first rows are decoded
        except Exception:  # noqa: BLE001 - its caller runs it again, and has its error then
            refused = None
        if refused is not None:
            progress.abandon()  # the caller refuses the photo: decoding the rest would be waste
            return None
    rows, columns = source.shape[:2]
    bands = Bands(source, columns, rows, size)
    encoder = _jpegrows.Encoder(size[0], size[1], quality)
    width = size[0]
    rgb, narrow = bytearray(width * 3 * size[1]), bytearray()
    done, decoded = 0, 0
    while done < size[1]:
        decoded = progress.beyond(decoded)
        if not decoded:
            return None  # the decode failed: its caller has the error
        end = bands.ready(decoded)
        least = max(1, size[1] // OUT_BANDS) if decoded < rows - FINAL else 1
        if end > done and (end - done >= least or end == size[1]):
            band = bands.rows(done, end)
            encoder.write(band)
            rgb[done * width * 3:end * width * 3] = band
            narrow += narrowed(Image.frombuffer("RGB", (width, end - done), band, "raw", "RGB", 0, 1).convert("L"))
            done = end
    return Downscaled(encoder.finish(), rgb, narrow)


# The sampling layouts libjpeg-turbo's whole-picture API (simplejpeg) takes: luma (h, v) with
# chroma at (1, 1). It refuses others, which the scanline API would decode: a photo in one of
# those is decoded whole, so that whether it is taken does not depend on a core being free.
_STANDARD_LUMA = {(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)}


def standard_sampling(image: Image.Image) -> bool:
    """Whether the colour JPEG `image` (opened by Pillow) has a layout both decoders take."""
    layers = getattr(image, "layer", None) or []
    return (len(layers) == 3 and tuple(layers[0][1:3]) in _STANDARD_LUMA
            and all(tuple(layer[1:3]) == (1, 1) for layer in layers[1:]))


def encode(pixels, size: tuple[int, int], quality: int) -> bytes:
    """RGB rows of `size` as a baseline 4:2:0 JPEG at `quality`, by the encoder the streamed
    path uses where it is built (so that a photo's bytes, which key the engines' caches, do
    not depend on which path it took), else by simplejpeg."""
    if _jpegrows is None:
        return simplejpeg.encode_jpeg(np.frombuffer(pixels, np.uint8).reshape(size[1], size[0], 3),
                                      quality=quality, colorspace="RGB", colorsubsampling="420", fastdct=False)
    encoder = _jpegrows.Encoder(size[0], size[1], quality)
    encoder.write(pixels)
    return encoder.finish()
