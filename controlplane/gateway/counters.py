"""Counters of this gateway process, exposed at /metrics (each replica reports its own)."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
requests: Counter = Counter()  # (tier, status) -> requests answered
image_tokens: Counter = Counter()  # tier -> image tokens sent to engines
disagreements: Counter = Counter()  # tier -> answers whose engine image count differed
pictures: Counter = Counter()  # (tier, "new" or "again") -> pictures prepared for engines
# What the store of pictures replicas share did when asked or given one: "hit", "miss",
# "failed" (unreachable, slow, refused), "dropped" (too many waiting to be written).
shared_pictures: Counter = Counter()


def count(*, tier: str, status: str, images: int = 0, disagree: bool = False) -> None:
    with _lock:
        requests[(tier, status)] += 1
        if images:
            image_tokens[tier] += images
        if disagree:
            disagreements[tier] += 1


def picture(*, tier: str, again: bool) -> None:
    """A picture prepared for an engine: `again` when what it became before was taken."""
    with _lock:
        pictures[(tier, "again" if again else "new")] += 1


def shared_picture(outcome: str) -> None:
    with _lock:
        shared_pictures[outcome] += 1


def shared_snapshot() -> dict:
    with _lock:
        return dict(shared_pictures)


def snapshot() -> tuple[dict, dict, dict, dict]:
    with _lock:
        return dict(requests), dict(image_tokens), dict(disagreements), dict(pictures)
