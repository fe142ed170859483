"""Serving the ASGI application with uvicorn, bounded against slow and greedy clients.

uvicorn closes idle keep-alive connections, but takes request headers of any size and number,
and a client that opens a connection and sends nothing, or trickles its headers a byte at a
time, holds it for as long as it likes. This protocol (uvicorn's httptools protocol):
- closes a connection whose request headers have not all arrived within HTTP_HEADER_TIMEOUT_S
  of the connection opening or the request starting;
- answers 431 to headers past HTTP_MAX_HEADER_BYTES in all, HTTP_MAX_HEADER_LINE_BYTES a field
  or HTTP_MAX_HEADERS fields (414 to a longer URL), counted before they are parsed, and closes
  the connection;
- closes at once a connection past HTTP_MAX_CONNECTIONS, or past HTTP_MAX_CONNECTIONS_PER_CLIENT
  from one address (a trusted proxy's excepted: with --proxy-headers, FORWARDED_ALLOW_IPS).
Bodies have their own bounds in the application (see asgi.py), which answers before reading a
body it will not take; such an answer closes the connection gently, as a 431 does.

    python -m controlplane.serving --host 0.0.0.0 --port 8000 [--workers N] [--proxy-headers]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource

import uvicorn
from django.conf import settings
from uvicorn.middleware.proxy_headers import _TrustedHosts
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from controlplane.client_slots import ClientSlots

# How long a connection closed on a client still sending drops what arrives, before closing.
LINGER_S = 2.0
# And how much of it is read and dropped at most: a client that would send tens of megabytes
# more is cut off (a reset) rather than have the event loop read them for nothing.
LINGER_BYTES = 8 << 20


class _HeadRefused(Exception):
    """Stops the parser in the middle of a request's head (it wraps this in its own error)."""


class _ServerConnections:
    """What one server's connections share: which are open, by address, and which addresses
    are trusted proxies."""

    def __init__(self, config):
        self.open = ClientSlots("connections")
        # uvicorn's own reading of FORWARDED_ALLOW_IPS, as its proxy headers middleware uses it.
        self.proxies = _TrustedHosts(config.forwarded_allow_ips) if config.proxy_headers else None

    @classmethod
    def of(cls, protocol: HttpToolsProtocol) -> _ServerConnections:
        # uvicorn hands every connection of a server the same ServerState: they are kept on it.
        shared = getattr(protocol.server_state, "bounded_connections", None)
        if shared is None:
            shared = protocol.server_state.bounded_connections = cls(protocol.config)
        return shared


class BoundedHttpProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timeout_s = settings.HTTP_HEADER_TIMEOUT_S
        self._max_head, self._max_line = settings.HTTP_MAX_HEADER_BYTES, settings.HTTP_MAX_HEADER_LINE_BYTES
        self._max_fields = settings.HTTP_MAX_HEADERS
        self._headers_deadline, self._lingering, self._refusal = None, False, None
        self._awaiting_head, self._head_room, self._fields = True, self._max_head, 0
        self._server_connections, self._peer = _ServerConnections.of(self), None
        peer = self.client[0] if self.client else ""
        proxies = self._server_connections.proxies
        per_client = 0 if proxies is not None and peer in proxies else settings.HTTP_MAX_CONNECTIONS_PER_CLIENT
        if self._server_connections.open.take(peer, overall=settings.HTTP_MAX_CONNECTIONS,
                                              per_client=per_client) is not None:
            transport.close()
            return
        self._peer = peer
        self._arm_headers_deadline()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the answer is given and the connection closing: what still comes is dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.abort()
            return
        if self._awaiting_head and len(data) > self._head_room:
            # Only what the head may still take is parsed; the rest once the head has ended.
            fits, self._head_room = self._head_room, 0
            super().data_received(data[:fits])
            if self._lingering or self.transport.is_closing():
                return
            if self._awaiting_head:
                self._refuse(431, f"the request's header fields exceed {self._max_head} bytes")
                return
            self.data_received(data[fits:])
            return
        if self._awaiting_head:
            self._head_room -= len(data)
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._fields, self._refusal = 0, None
        self._arm_headers_deadline()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self._max_line:
            self._refusal = (414, f"the request's URL exceeds {self._max_line} bytes")
            raise _HeadRefused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self._max_fields:
            self._refusal = (431, f"the request has more than {self._max_fields} header fields")
            raise _HeadRefused
        if len(name) + len(value) > self._max_line:
            self._refusal = (431, f"a request header field exceeds {self._max_line} bytes")
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_headers_deadline()
        self._awaiting_head = False
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:
            self.cycle.transport = _GentleClose(self, self.cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head, self._head_room = True, self._max_head  # the next request's

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # the parser stopped on a limit of ours
            self._refuse(*self._refusal)
        else:
            super().send_400_response(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_headers_deadline()
        if self._peer is not None:
            self._server_connections.open.give_back(self._peer)
            self._peer = None
        super().connection_lost(exc)

    def close_gently(self) -> None:
        """Closes the connection once the client can have read what was written. Closed at
        once while the client still sends, the kernel answers the bytes left unread with a
        reset, which a client can meet before it reads the answer (and report a broken
        connection instead): so writing ends, and what still comes is read and dropped for
        LINGER_S, or until the client closes its side, or LINGER_BYTES have been dropped."""
        if self.transport.is_closing() or self._lingering:
            return
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering, self._dropped = True, 0
        self._disarm_headers_deadline()
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _refuse(self, status: int, message: str) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request's head: the answer being written has the connection
            return
        body = f"{message}\n".encode()
        head = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        self.transport.write(STATUS_LINE[status] + head + b"content-type: text/plain; charset=utf-8\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.close_gently()

    def _arm_headers_deadline(self) -> None:
        if self._headers_deadline is None:
            self._headers_deadline = self.loop.call_later(self._header_timeout_s, self._headers_too_slow)

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
    allow_open_files()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")  # as the application sets it
    uvicorn.run(app, host=host, port=port, workers=workers, log_level=log_level, proxy_headers=proxy_headers,
                access_log=access_log, http=BoundedHttpProtocol, loop="auto",
                timeout_graceful_shutdown=settings.SHUTDOWN_GRACE_S)  # gateway/stopping.py


def allow_open_files() -> None:
    """Raises this process's soft limit on open files to its hard limit. Past the soft limit
    (often 1024, below HTTP_MAX_CONNECTIONS) accepting a connection fails, and asyncio stops
    accepting anyone's for a second: a cap would then stall every client, not refuse one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # a hard limit past the kernel's nr_open: keep the soft one
            pass


if __name__ == "__main__":
    main()
