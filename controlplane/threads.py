"""Pools of worker threads kept per process.

Each process makes its own on first use: a child forked after its parent had one would
otherwise hold a pool whose threads are gone, and wait on it for ever.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class Threads:
    """A pool of `workers` threads named `name`, made in each process on first use."""

    def __init__(self, name: str, workers: int):
        self.name, self.workers = name, workers
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name))
            return self._pool[1]
