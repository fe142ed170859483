"""/v1 as a plain ASGI app: no sessions, cookies, CSRF or middleware, which the API does not
use and which would cost every request thread hops. The handlers are the same as the Django
views'."""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from controlplane.gateway import handlers, upstream
from controlplane.gateway.errors import error_response
from controlplane.gateway.http import Request, Response
from controlplane.gateway.memory import keep_freed_buffers

log = logging.getLogger(__name__)
keep_freed_buffers(settings.GATEWAY_HEAP_KEEP_MB)
ROUTES = {"/v1/models": handlers.models, "/v1/chat/completions": handlers.chat_completions}
CONNECTION_CHECK_SECONDS = 30
_last_check = 0.0


async def _connection_hygiene() -> None:
    """What Django does around each request, done here now and then: the rare cache misses
    query the database from one thread, whose connection must not go stale or broken."""
    global _last_check
    if time.monotonic() - _last_check > CONNECTION_CHECK_SECONDS:
        _last_check = time.monotonic()
        await sync_to_async(_close_old_connections)()


def _close_old_connections() -> None:
    from django.db import connection

    if not connection.in_atomic_block:  # never in the middle of a transaction
        close_old_connections()


async def _read_body(receive) -> tuple[bytes | None, bool]:
    """The body, or None when it is too large; and whether the client already left."""
    limit = settings.GATEWAY_MAX_BODY_BYTES
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        if not message.get("more_body"):
            return (b"".join(chunks) if size <= limit else None), False


async def _send(send, response: Response) -> None:
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(name.lower().encode(), str(value).encode()) for name, value in response.headers.items()]
    try:
        if response.stream is None:
            headers.append((b"content-length", str(len(response.body)).encode()))
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            await send({"type": "http.response.body", "body": response.body})
            return
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        try:
            async for chunk in response.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await response.stream.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        if response.on_close is not None:  # also when the stream never started
            await response.on_close()


async def lifespan(receive, send) -> None:
    """The server's start and stop: on stopping (once it has answered every request it was
    given), the work answered requests left in the background is done before the process exits."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await handlers.drain()
            await upstream.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope, receive, send) -> None:
    path = scope["path"]
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    handler, key = ROUTES.get(path), None
    if handler is not None and scope["method"] == "POST":
        # The key and the declared length are checked before a byte of the body is read:
        # nobody without a key makes the gateway buffer megabytes.
        key = await handlers.check_before_body(headers)
        if isinstance(key, Response):
            await _send(send, key)
            return
    try:
        async with asyncio.timeout(settings.GATEWAY_BODY_TIMEOUT_S):  # no task of its own, as wait_for makes
            body, gone = await _read_body(receive)
    except TimeoutError:
        await _send(send, error_response(408, f"the request body did not arrive within "
                                              f"{settings.GATEWAY_BODY_TIMEOUT_S}s", code="request_timeout"))
        return
    if gone:
        return
    await _connection_hygiene()
    request = Request(method=scope["method"], headers=headers, body=body, key=key)

    async def respond():
        if handler is None:
            response = await handlers.not_found(request, path.removeprefix("/v1/"))
        else:
            response = await handler(request)
        await _send(send, response)

    async def client_left():
        while (await receive())["type"] != "http.disconnect":
            pass

    # A client that leaves cancels the work done for it (the handlers record it as aborted).
    work, watch = asyncio.ensure_future(respond()), asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()
        else:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    except Exception:
        log.exception("gateway failure on %s", path)
        try:
            await _send(send, error_response(500, "the gateway failed on this request", code="internal_error"))
        except Exception:  # noqa: BLE001 - the response had already started
            pass
    finally:
        watch.cancel()
