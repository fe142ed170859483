"""Stopping a server process without failing a request: a rolling deploy sends SIGTERM.

At once the process turns unready (`/readyz` answers 503), so a load balancer stops sending it
new work, while it goes on serving whatever still comes for SHUTDOWN_DELAY_S (the balancer's
health checks take that long to notice). Then the server stops accepting, lets the requests
and streams it has finish within SHUTDOWN_GRACE_S, records their usage and exits. A stream
still open a second before the grace ends is ended with a clean error event and billed for
what was relayed, rather than cut. A second SIGTERM skips the delay.

The server's own handler (uvicorn's) is kept and called once the delay is over: whatever
serves the process, one worker or several, stops as it always did, later.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

STREAMS_MARGIN_S = 1.0  # before the grace ends: time for the streams' last events and their usage


@dataclass(eq=False)
class Stopping:
    """Where this process is in stopping (its GatewayProcess holds it)."""

    asked_at: float | None = None  # monotonic: when it was told to stop
    streams_ending: bool = False  # open streams end at their next event

    @property
    def ready(self) -> bool:
        return self.asked_at is None

    def install(self, loop: asyncio.AbstractEventLoop, *, delay_s: float, grace_s: float) -> bool:
        """Defer the server's SIGTERM handler by `delay_s`, turning unready at once; whether it
        could (only the main thread of a process a server runs handles signals)."""
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except ValueError:
            return False
        if not callable(previous):
            return False  # no server's handler to defer: the default one stops the process

        def told(sig, frame) -> None:
            if self.asked_at is not None:  # told again: stop now
                previous(sig, frame)
                return
            self.asked_at = time.monotonic()
            loop.call_soon_threadsafe(begin, sig)

        def begin(sig) -> None:
            log.warning("told to stop: unready now, stopping in %s s, streams ended after %s s more",
                        delay_s, max(0.0, grace_s - STREAMS_MARGIN_S))
            loop.call_later(delay_s, previous, sig, None)
            loop.call_later(delay_s + max(0.0, grace_s - STREAMS_MARGIN_S), self.end_streams)

        try:
            signal.signal(signal.SIGTERM, told)
        except ValueError:  # not the main thread (a server run by a test, say)
            return False
        return True

    def end_streams(self) -> None:
        self.streams_ending = True
