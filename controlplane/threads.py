"""Pools of worker threads kept per process.

Each process makes its own on first use: a child forked after its parent had one would
otherwise hold a pool whose threads are gone, and wait on it for ever.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

LOWEST = 19  # the largest niceness Linux gives


class Threads:
    """A pool of `workers` threads named `name`, made in each process on first use. With
    `background`, its threads run at the lowest scheduling priority: work that has time to
    spare yields the CPU to any other thread or process wanting it (on a shared core, the
    engine's own request handling), and takes what is left over."""

    def __init__(self, name: str, workers: int, *, background: bool = False):
        self.name, self.workers, self.background = name, workers, background
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix=self.name,
                    initializer=_lowest_priority if self.background else None))
            return self._pool[1]


def _lowest_priority() -> None:
    # Linux schedules threads: a thread's own niceness is set through its id.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
    except OSError:  # a platform without per-thread niceness: it runs as the rest
        pass
