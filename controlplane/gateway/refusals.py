"""Requests refused before a tier was chosen for them, kept where they can be seen without
letting anyone fill the database with them.

A refusal of a key of ours is kept in its tenant's usage, as any refused request is: a usable
key's refusals are bounded by its intake's throttle, like the rest of its requests. A key that
can no longer be used (revoked, expired, its tenant deactivated) has no throttle, and its
secret may be in the hands of a client left running or of whoever it leaked to: its refusals
are kept up to RECORDED_PER_KEY_MINUTE a minute by each gateway process, and only counted past
that. A request with no key of ours (none sent, or an unknown one) has no tenant, and anyone
can send it: it leaves no row.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

RECORDED_PER_KEY_MINUTE = 60


class RecordedRefusals:
    """How many refusals of each unusable key this process kept this minute (a key this
    minute's refusals named: no more of them than there are keys)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.minute: int | None = None
        self.kept: Counter = Counter()  # key id -> refusals kept this minute

    def take(self, key_id: int) -> bool:
        """Whether one more refusal of `key_id` is kept."""
        minute = int(self.clock() // 60)
        if minute != self.minute:
            self.minute, self.kept = minute, Counter()
        self.kept[key_id] += 1
        return self.kept[key_id] <= RECORDED_PER_KEY_MINUTE

