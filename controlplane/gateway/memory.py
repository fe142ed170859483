"""Keep the heap's freed image buffers for the next request instead of handing them back to
the kernel.

glibc serves an allocation above its mmap threshold with a fresh mapping and unmaps it on
free, and trims the heap's free top back to the kernel. Every image request allocates
megabytes at a time (the body, the base64 text, the decoded and resized pixels), so each one
touched fresh pages and paid a page fault per 4 KiB: on a 12 MP photo, ~12 ms of the
gateway's ~82 ms (bench/gateway). Raising both thresholds lets the heap reuse those pages.
The price is resident memory: up to `keep_mb` of free heap may stay mapped per arena.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit: larger values are refused


def keep_freed_buffers(keep_mb: int) -> bool:
    """Tune glibc's malloc for this process. False where it does not apply (keep_mb 0, not
    Linux, or a libc without mallopt, such as musl)."""
    if keep_mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    keep = keep_mb * 1024 * 1024
    tuned = mallopt(M_MMAP_THRESHOLD, min(keep, MMAP_THRESHOLD_MAX)) and mallopt(M_TRIM_THRESHOLD, keep)
    if not tuned:
        log.warning("malloc tuning refused; image buffers are returned to the kernel after each request")
    return bool(tuned)
