"""What decoding one request's pictures may cost: pixels, memory and CPU time.

Everything a picture's decode will need is read from its header first (its size, its mode,
a JPEG's scans), and the picture is refused before any pixel is decoded when that would pass
what its request has left. What a header cannot tell (how long the decoder will take) is
bounded as the decode runs: the decoder stops once its thread has used the picture's CPU time,
and the CPU time every picture took is counted, for the caller to charge to whoever sent it.
Pure Python: no Django, no Celery.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from controlplane.imaging.errors import ImageTooComplex, ImageTooLarge

MB = 1 << 20
# Scans a JPEG may have: encoders write 1 to 3 for a baseline photo and about 10 for a
# progressive one (libjpeg's default script; mozjpeg's tuned ones, a few more).
DEFAULT_MAX_SCANS = 64


@dataclass(frozen=True)
class DecodeLimits:
    max_scans: int = DEFAULT_MAX_SCANS  # of a JPEG
    picture_cpu_s: float = 2.0  # a 16 MP photo of noise decodes in under 1 s, progressive or WebP
    request_cpu_s: float = 4.0
    picture_memory: int = 512 * MB
    request_memory: int = 1024 * MB


# Bytes a decoded pixel takes in each Pillow mode (others: 4).
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "LA": 2, "PA": 2, "La": 2, "I;16": 2, "I;16B": 2, "I;16L": 2,
               "I;16N": 2, "RGB": 3, "YCbCr": 3, "LAB": 3, "HSV": 3}


def decode_memory(width: int, height: int, mode: str, *, coefficients: int = 0) -> int:
    """A bound on what decoding a `width` x `height` picture of `mode` to RGB holds at once:
    its pixels as decoded, a conversion's copy on the way, and the RGB result (and, for a
    progressive JPEG, its `coefficients` components' DCT coefficients, 2 bytes a pixel each,
    which libjpeg keeps whatever the scale it decodes at)."""
    pixels = width * height
    stored = _MODE_BYTES.get(mode, 4)
    return pixels * (stored + (0 if mode == "RGB" else 4) + 3 + 2 * coefficients)


class DecodersBusy(Exception):
    """The process's decodes hold all the memory they may: a picture waited for its share in
    vain. Not the picture's fault: the request may be sent again shortly."""


class DecodeMemory:
    """The memory one process's decodes may hold at once, estimated from their pictures'
    headers, and the decodes it runs at once (`decodes`: by default one fewer than its cores,
    so that its event loop keeps one whatever the pictures), handed out as they are given back;
    a decode that cannot have its share within `wait_s` is refused (DecodersBusy)."""

    def __init__(self, total: int, *, wait_s: float, decodes: int = 0):
        self.total, self.wait_s = total, wait_s
        self.decodes = decodes or max(1, len(os.sched_getaffinity(0)) - 1)
        self._held = self._running = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        with self._changed:
            return self._held

    @contextmanager
    def holding(self, amount: int) -> Iterator[None]:
        amount = min(amount, self.total)  # one larger than all is let through alone
        with self._changed:
            if not self._changed.wait_for(lambda: self._held + amount <= self.total and self._running < self.decodes,
                                          timeout=self.wait_s):
                raise DecodersBusy("the gateway is decoding as many images as it can at once; retry shortly")
            self._held += amount
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._held -= amount
                self._running -= 1
                self._changed.notify_all()


class DecodeBudget:
    """What one request's pictures may still cost. Thread-safe: a request's pictures are
    decoded and checked on several threads. With `shared`, their decodes also hold their
    memory in the process's."""

    def __init__(self, limits: DecodeLimits = DecodeLimits(), *, pixels: int | None = None,
                 shared: DecodeMemory | None = None):
        self.limits, self.shared = limits, shared
        self._pixels_total = pixels
        self._pixels = 0
        self._memory = 0
        self._cpu = 0.0
        self._lock = threading.Lock()

    @property
    def cpu_spent(self) -> float:
        """CPU seconds the pictures' decodes and checks have used so far."""
        with self._lock:
            return self._cpu

    def count_pixels(self, width: int, height: int) -> None:
        """A picture of the request, decoded or not: ImageTooLarge once the request's pictures
        pass their total."""
        with self._lock:
            if self._pixels_total is not None and self._pixels + width * height > self._pixels_total:
                raise ImageTooLarge(f"images in this request exceed {self._pixels_total} pixels in total")
            self._pixels += width * height

    def take_memory(self, memory: int) -> None:
        """Room for a decode that will hold `memory` bytes, before it starts: ImageTooLarge
        past the picture's or the request's budget."""
        limits = self.limits
        if memory > limits.picture_memory:
            raise ImageTooLarge(f"decoding this image would take {memory // MB:,} MB; at most "
                                f"{limits.picture_memory // MB:,} MB are allowed for one image")
        with self._lock:
            if self._memory + memory > limits.request_memory:
                raise ImageTooLarge(f"decoding the images of this request would take more than "
                                    f"{limits.request_memory // MB:,} MB")
            self._memory += memory

    @contextmanager
    def holding(self, memory: int) -> Iterator[None]:
        """`take_memory`, then the process's share of it held for the block (DecodersBusy)."""
        self.take_memory(memory)
        if self.shared is None:
            yield
            return
        with self.shared.holding(memory):
            yield

    def cpu_allowed(self) -> float:
        """CPU seconds the next decode may take: its picture's budget, or what the request has
        left, whichever is less. ImageTooComplex when nothing is left."""
        with self._lock:
            left = min(self.limits.picture_cpu_s, self.limits.request_cpu_s - self._cpu)
        if left <= 0:
            raise ImageTooComplex(f"decoding the images of this request took more than "
                                  f"{self.limits.request_cpu_s:g} s of CPU time")
        return left

    def spend(self, seconds: float) -> None:
        with self._lock:
            self._cpu += seconds

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the CPU time this thread spends in the block."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.spend(time.thread_time() - started)


class CpuDeadline(io.BytesIO):
    """Picture bytes for Pillow's decoders, which read their input a block at a time as they
    decode: past `seconds` of this thread's CPU time from its making, the next read stops the
    decode (ImageTooComplex), freeing the thread."""

    def __init__(self, data: bytes, seconds: float):
        super().__init__(data)
        self._deadline, self._seconds = time.thread_time() + seconds, seconds

    def read(self, size: int | None = -1) -> bytes:
        if time.thread_time() > self._deadline:
            raise ImageTooComplex(f"decoding this image took more than {self._seconds:g} s of CPU time")
        return super().read(size)
