"""Things a server holds at once for its clients (connections, request bodies being read),
counted overall and per client address, so that no one address can take them all, and
(bodies) weighed in the bytes they may grow to, so that what they hold is bounded too."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Literal

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # a flood of refusals is one warning now and then, not a flood of lines

Cap = Literal["client", "overall"]


class ClientSlots:
    """Slots held at once, overall and per client; a cap of 0 is no cap. Used from one event
    loop (one per server process), so it needs no lock."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.held = 0
        self.weight = 0  # of what is held: a body's declared length, or the most it may be
        self._by_client: Counter[str] = Counter()
        self._refused, self._warned_at = 0, float("-inf")

    def take(self, client: str, *, overall: int, per_client: int, weight: int = 0,
             overall_weight: int = 0) -> Cap | None:
        """A slot for `client` weighing `weight`, or, when a cap is reached, none and which cap
        it was. One slot alone is never refused for its weight."""
        if per_client and self._by_client[client] >= per_client:
            return self._refuse(client, "client")
        if overall and self.held >= overall:
            return self._refuse(client, "overall")
        if overall_weight and self.held and self.weight + weight > overall_weight:
            return self._refuse(client, "overall")
        self.held += 1
        self.weight += weight
        self._by_client[client] += 1
        return None

    def give_back(self, client: str, weight: int = 0) -> None:
        self.held -= 1
        self.weight -= weight
        self._by_client[client] -= 1
        if self._by_client[client] <= 0:
            del self._by_client[client]

    def _refuse(self, client: str, cap: Cap) -> Cap:
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("%s: refused %d past the %s cap (last for %s, %d held)", self.what, self._refused,
                        "per-address" if cap == "client" else "overall", client or "an unknown address", self.held)
            self._refused, self._warned_at = 0, now
        return cap


def client_address(scope) -> str:
    """An ASGI request's client address: its connection's peer, or the client a trusted
    proxy named (uvicorn's --proxy-headers)."""
    client = scope.get("client")
    return client[0] if client else ""
