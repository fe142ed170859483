"""Pooled HTTP connections: to engines (aiohttp), and to other services (httpx).

Every request the gateway serves crosses to an engine and back, so that hop is on aiohttp,
whose HTTP parser is C: measured on the text path (bench/gateway), httpx and httpcore took
37 % of the gateway's CPU per request, more than everything else it does. The rare calls to
other services (moderation) keep httpx.

An engine call fails in one of two ways, and they mean different things to the caller:
`Unreachable` (nothing reached the engine: another one may take the request) and `Broken`
(the exchange failed once the engine may have started: running it again could run it twice).
"""

from __future__ import annotations

import asyncio
import weakref

import aiohttp
import httpx
from django.conf import settings

from controlplane import outbound

# Engines behind uvicorn (vLLM, the simulator) close an idle connection after 5 s: one idle
# for 4 s is dropped here first, so a request never goes out on a connection being closed.
KEEPALIVE_S = 4
# aiohttp reads a line of a streamed answer whole up to twice this (an SSE event with many
# logprobs can be long); a longer one is a broken answer.
READ_BUFFER_BYTES = 2**20


class Unreachable(Exception):
    """The engine could not be reached: nothing was sent to it."""


class Broken(Exception):
    """The exchange with the engine failed after the request may have reached it."""


class EngineResponse:
    """An engine's answer once its headers arrived: read whole, or line by line."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status_code = response.status
        self._finished = False

    async def read(self) -> bytes:
        try:
            body = await self._response.read()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        self._finished = True
        return body

    async def lines(self):
        """Its lines, without their line ends."""
        content = self._response.content
        try:
            while line := await content.readline():
                yield line.rstrip(b"\r\n").decode()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        self._finished = True

    async def aclose(self) -> None:
        """Back to the pool when read to the end; otherwise the connection is closed, which
        is how an engine learns that nobody waits for the rest (vLLM then aborts it)."""
        if self._finished:
            self._response.release()
        else:
            self._response.close()


class Connections:
    """A gateway process's pooled connections, one pool per event loop (a server runs one
    loop; a test run, many): to engines on aiohttp, to other services on httpx."""

    def __init__(self):
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def client(self) -> httpx.AsyncClient:
        """To other services (moderation), whose URLs operators set: each request is vetted and
        goes to the address vetted, with no redirect (controlplane/outbound.py)."""
        loop = asyncio.get_running_loop()
        pooled = self._clients.get(loop)
        if pooled is None or pooled.is_closed:
            pooled = outbound.async_client(
                trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS, what="moderation URL",
                timeout=httpx.Timeout(settings.GATEWAY_UPSTREAM_TIMEOUT, connect=3.0),
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            )
            self._clients[loop] = pooled
        return pooled

    def _engine_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._engines.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                                               ttl_dns_cache=60),
                # No bound on the whole answer (a long generation streams for minutes); a bound on
                # connecting, and on the silence between two reads.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=3.0,
                                              sock_read=settings.GATEWAY_UPSTREAM_TIMEOUT),
                read_bufsize=READ_BUFFER_BYTES, auto_decompress=False, skip_auto_headers=("User-Agent",),
            )
            self._engines[loop] = session
        return session

    async def engine_post(self, url: str, *, content: bytes, headers: dict[str, str]) -> EngineResponse:
        """POST to an engine and wait for the headers of its answer."""
        try:
            response = await self._engine_session().post(url, data=content, headers=headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        return EngineResponse(response)

    async def close(self) -> None:
        """Close this event loop's pooled connections, to engines and to other services: the
        server's last act once every request is answered, so that no engine is left holding a
        connection to a gateway that is gone until it finds it idle."""
        loop = asyncio.get_running_loop()
        session, pooled = self._engines.pop(loop, None), self._clients.pop(loop, None)
        if session is not None and not session.closed:
            await session.close()
        if pooled is not None and not pooled.is_closed:
            await pooled.aclose()

    def close_after_loops_ended(self) -> None:
        """Let go of the engine sessions pooled by event loops that have ended without closing
        them (a process that ran many loops, as a test run does), so that none is reported
        unclosed when the process exits. With their loop gone nothing can run a close: each is
        marked closed, and its sockets close as they are collected."""
        for loop, session in list(self._engines.items()):
            if loop.is_running() or session.closed:
                continue
            connector = session.connector
            session.detach()
            del self._engines[loop]
            if connector is not None:
                connector._close()  # aiohttp's synchronous close: on a closed loop it only marks itself
