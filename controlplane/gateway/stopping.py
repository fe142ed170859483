"""Stopping a server process without failing a request: a rolling deploy sends SIGTERM.

At once the process turns unready (`/readyz` answers 503), so a load balancer stops sending it
new work, while it goes on serving whatever still comes for SHUTDOWN_DELAY_S (the balancer's
health checks take that long to notice). Then the server stops accepting, lets the requests
and streams it has finish within SHUTDOWN_GRACE_S, records their usage and exits. A stream
still open a second before the grace ends is ended with a clean error event and billed for
what was relayed, rather than cut. A second SIGTERM (seconds later: one sent to a whole process
group arrives twice at once) or a SIGINT skips the delay.

The server's own handler (uvicorn's) is kept and called once the delay is over: whatever
serves the process, one worker or several, stops as it always did, later.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

STREAMS_MARGIN_S = 1.0  # before the grace ends: time for the streams' last events and their usage
REPEATED_S = 2.0  # a second SIGTERM within this of the first is the same one (sent to a process group)
STREAMS_ENDING = object()  # among a stream's lines (engine_watch.watched_lines): its process ends it now


@dataclass(eq=False)
class Stopping:
    """Where this process is in stopping (its GatewayProcess holds it)."""

    asked_at: float | None = None  # monotonic: when it was told to stop
    streams_ending: bool = False  # open streams end now
    cutting: bool = False  # its grace over, the server cuts the requests left (not their clients leaving)
    # What tells each open stream, on its own event loop: one whose engine is silent (its request
    # queued, in a long prefill) has no event of its own to end on before the grace runs out.
    _ending: dict[object, Callable[[], None]] = field(default_factory=dict, repr=False)

    @property
    def ready(self) -> bool:
        return self.asked_at is None

    def install(self, loop: asyncio.AbstractEventLoop, *, delay_s: float, grace_s: float) -> bool:
        """Defer the server's SIGTERM handler by `delay_s`, turning unready at once; whether it
        could (only the main thread of a process a server runs handles signals)."""
        try:
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:
            return False
        if not all(callable(handler) for handler in previous.values()):
            return False  # no server's handlers to defer: the defaults stop the process
        timers: list[asyncio.TimerHandle] = []

        def stop(sig, after_s: float) -> None:
            """The server's own stop, `after_s` from now; open streams ended a second before
            the grace it then gives them runs out."""
            for timer in timers:
                timer.cancel()
            timers[:] = [loop.call_later(after_s, previous[sig], sig, None),
                         loop.call_later(after_s + max(0.0, grace_s - STREAMS_MARGIN_S), self.end_streams)]

        def told(sig, frame) -> None:
            now = time.monotonic()
            if sig == signal.SIGTERM and self.asked_at is None:
                self.asked_at = now
                log.warning("told to stop: unready now, stopping in %s s", delay_s)
                loop.call_soon_threadsafe(stop, sig, delay_s)
            elif sig == signal.SIGTERM and now - self.asked_at <= REPEATED_S:
                pass  # sent to a whole process group, it reaches a worker from its parent too: the same
            else:  # asked again, or interrupted: stop now
                self.asked_at = self.asked_at or now
                loop.call_soon_threadsafe(stop, sig, 0)

        try:
            for sig in previous:
                signal.signal(sig, told)
        except ValueError:  # not the main thread (a server run by a test, say)
            return False
        return True

    def when_streams_end(self, callback: Callable[[], None]) -> Callable[[], None]:
        """`callback` called on the caller's event loop once open streams are to end (soon, if
        they already are); what it returns forgets it, when the stream has ended."""
        call = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, callback)
        if self.streams_ending:
            call()
            return lambda: None
        token = object()
        self._ending[token] = call
        return functools.partial(self._ending.pop, token, None)

    def end_streams(self) -> None:
        self.streams_ending = True
        for call in list(self._ending.values()):
            call()
