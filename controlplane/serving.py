"""Serving the ASGI application with uvicorn, bounded against slow clients.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends
nothing, or trickles its headers a byte at a time, holds it for as long as it likes. This
protocol (uvicorn's httptools protocol) closes a connection whose request headers have not
all arrived within HTTP_HEADER_TIMEOUT_S of the connection opening or the request starting.
Bodies have their own bound in the application (GATEWAY_BODY_TIMEOUT_S, see asgi.py).

    python -m controlplane.serving --host 0.0.0.0 --port 8000 [--workers N] [--proxy-headers]
"""

from __future__ import annotations

import argparse
import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float | None = None  # None: HTTP_HEADER_TIMEOUT_S from the settings

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._headers_deadline = None
        self._arm_headers_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_headers_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_headers_deadline()
        super().on_headers_complete()

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
                access_log=access_log, http=HeaderTimeoutProtocol, loop="auto")


if __name__ == "__main__":
    main()
