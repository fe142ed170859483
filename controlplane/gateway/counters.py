"""Counters of this gateway process, exposed at /metrics (each replica reports its own)."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """One process's counts; kept by its GatewayProcess."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (tier, status) -> requests answered
        self.image_tokens: Counter = Counter()  # tier -> image tokens sent to engines
        self.disagreements: Counter = Counter()  # tier -> answers whose engine image count differed
        self.pictures: Counter = Counter()  # (tier, "new" or "again") -> pictures prepared for engines
        # What the store of pictures replicas share did when asked or given one: "hit", "miss",
        # "failed" (unreachable, slow, refused), "dropped" (too many waiting to be written).
        self.shared_pictures: Counter = Counter()
        # A cascade's first answers: (its rule, "kept" or why it was escalated).
        self.cascades: Counter = Counter()
        # Requests refused at authentication, by why (authentication.NotAuthenticated.reason).
        self.auth_refusals: Counter = Counter()

    def count(self, *, tier: str, status: str, images: int = 0, disagree: bool = False) -> None:
        with self._lock:
            self.requests[(tier, status)] += 1
            if images:
                self.image_tokens[tier] += images
            if disagree:
                self.disagreements[tier] += 1

    def picture(self, *, tier: str, again: bool) -> None:
        """A picture prepared for an engine: `again` when what it became before was taken."""
        with self._lock:
            self.pictures[(tier, "again" if again else "new")] += 1

    def shared_picture(self, outcome: str) -> None:
        with self._lock:
            self.shared_pictures[outcome] += 1

    def cascade(self, *, rule: str, outcome: str) -> None:
        with self._lock:
            self.cascades[(rule, outcome)] += 1

    def auth_refused(self, reason: str) -> None:
        with self._lock:
            self.auth_refusals[reason] += 1

    def auth_refusal_snapshot(self) -> dict:
        with self._lock:
            return dict(self.auth_refusals)

    def cascade_snapshot(self) -> dict:
        with self._lock:
            return dict(self.cascades)

    def shared_snapshot(self) -> dict:
        with self._lock:
            return dict(self.shared_pictures)

    def snapshot(self) -> tuple[dict, dict, dict, dict]:
        with self._lock:
            return dict(self.requests), dict(self.image_tokens), dict(self.disagreements), dict(self.pictures)
