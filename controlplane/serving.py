"""Serving the ASGI application with uvicorn, bounded against slow clients.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends
nothing, or trickles its headers a byte at a time, holds it for as long as it likes. This
protocol (uvicorn's httptools protocol) closes a connection whose request headers have not
all arrived within HTTP_HEADER_TIMEOUT_S of the connection opening or the request starting.
Bodies have their own bound in the application (GATEWAY_BODY_TIMEOUT_S, see asgi.py), which
answers before reading a body it will not take; such an answer closes the connection gently.

    python -m controlplane.serving --host 0.0.0.0 --port 8000 [--workers N] [--proxy-headers]
"""

from __future__ import annotations

import argparse
import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# How long a connection closed on a client still sending drops what arrives, before closing.
LINGER_S = 2.0


class BoundedHttpProtocol(HttpToolsProtocol):
    header_timeout_s: float | None = None  # None: HTTP_HEADER_TIMEOUT_S from the settings

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._headers_deadline, self._lingering = None, False
        self._arm_headers_deadline()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is given and the connection closing: what still comes is dropped
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm_headers_deadline()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:
            self.cycle.transport = _GentleClose(self, self.cycle)

    def close_gently(self) -> None:
        """Closes the connection once the client can have read what was written. Closed at
        once while the client still sends, the kernel answers the bytes left unread with a
        reset, which a client can meet before it reads the answer (and report a broken
        connection instead): so writing ends, and what still comes is read and dropped for
        LINGER_S, or until the client closes its side."""
        if self.transport.is_closing() or self._lingering:
            return
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self._disarm_headers_deadline()
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_headers_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_headers_deadline()
        super().connection_lost(exc)

    def _arm_headers_deadline(self) -> None:
        if self._headers_deadline is None:
            from django.conf import settings  # loaded with the application, before any connection

            timeout = self.header_timeout_s or settings.HTTP_HEADER_TIMEOUT_S
            self._headers_deadline = self.loop.call_later(timeout, self._headers_too_slow)

    def _disarm_headers_deadline(self) -> None:
        if getattr(self, "_headers_deadline", None) is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _headers_too_slow(self) -> None:
        self._headers_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class _GentleClose:
    """The connection's transport as one request's cycle uses it: closed before the request's
    body has all arrived, it closes gently (BoundedHttpProtocol.close_gently)."""

    def __init__(self, protocol: BoundedHttpProtocol, cycle):
        self._protocol, self._cycle, self._transport = protocol, cycle, protocol.transport

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._cycle.more_body and not self._cycle.disconnected:
            self._protocol.close_gently()
        else:
            self._transport.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m controlplane.serving")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--proxy-headers", action="store_true")
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args(argv)
    serve("controlplane.asgi:application", host=args.host, port=args.port, workers=args.workers,
          log_level=args.log_level, proxy_headers=args.proxy_headers, access_log=args.access_log)


def serve(app, *, host: str, port: int, workers: int = 1, log_level: str = "info", proxy_headers: bool = False,
          access_log: bool = False) -> None:
    """Serve `app` (an import string, or with one worker the application itself) as the
    control plane is served."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, workers=workers, log_level=log_level, proxy_headers=proxy_headers,
                access_log=access_log, http=BoundedHttpProtocol, loop="auto")


if __name__ == "__main__":
    main()
