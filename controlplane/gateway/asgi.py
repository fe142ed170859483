"""/v1 as a plain ASGI app: no sessions, cookies, CSRF or middleware, which the API does not
use and which would cost every request thread hops. The handlers are the same as the Django
views'."""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection

from controlplane.client_slots import Cap, ClientSlots, client_address
from controlplane.gateway import handlers, state
from controlplane.gateway.apps import current_process
from controlplane.gateway.body import ShapeCount, TooComplex
from controlplane.gateway.errors import GatewayError, error_response
from controlplane.gateway.http import Request, Response
from controlplane.gateway.memory import keep_freed_buffers
from controlplane.gateway.recording import answering, settle

log = logging.getLogger(__name__)
keep_freed_buffers(settings.GATEWAY_HEAP_KEEP_MB)
# Each path with the one method it answers.
ROUTES = {"/v1/models": ("GET", handlers.models), "/v1/chat/completions": ("POST", handlers.chat_completions)}
CONNECTION_CHECK_SECONDS = 30
BUSY_RETRY_AFTER_S = 1  # a body read ends in well under a second, or at GATEWAY_BODY_TIMEOUT_S
SMALL_BODY = 64 * 1024  # bytes of a declared body the caps on bodies read at once leave uncounted


async def _connection_hygiene() -> None:
    """What Django does around each request, done here now and then: the rare cache misses
    query the database from one thread, whose connection must not go stale or broken."""
    process = current_process()
    if time.monotonic() - process.connections_checked_at > CONNECTION_CHECK_SECONDS:
        process.connections_checked_at = time.monotonic()
        await sync_to_async(_close_old_connections)()


def _close_old_connections() -> None:
    if not connection.in_atomic_block:  # never in the middle of a transaction
        close_old_connections()


async def _read_body(receive, declared: int | None = None) -> bytes | bytearray | GatewayError | None:
    """The body; or why it is refused when it is too large or too slow, as soon as it is; or
    None when the client left. A body of `declared` bytes is copied, a piece at a time as it comes,
    into a buffer of its size: joined at its end instead, 50 MB held the event loop 10 ms."""
    limit, chunks, size, shape = settings.GATEWAY_MAX_BODY_BYTES, [], 0, ShapeCount()
    whole = bytearray(declared) if declared and declared <= limit else None
    try:
        async with asyncio.timeout(settings.GATEWAY_BODY_TIMEOUT_S):  # no task of its own, as wait_for makes
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                if size + len(chunk) > (limit if whole is None else len(whole)):  # past the limit, or its length
                    return GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
                try:  # a body of more JSON than a request can use is refused at its first megabytes
                    shape.feed(chunk)
                except TooComplex as exc:
                    return GatewayError(400, str(exc), code="request_too_complex")
                if whole is None:
                    chunks.append(chunk)
                else:
                    whole[size:size + len(chunk)] = chunk
                size += len(chunk)
                if not message.get("more_body"):
                    if whole is None:
                        return b"".join(chunks)
                    return whole if size == len(whole) else whole[:size]
    except TimeoutError:
        return GatewayError(408, f"the request body did not arrive within {settings.GATEWAY_BODY_TIMEOUT_S}s",
                            code="request_timeout")


async def _read_body_within_caps(scope, receive, body_reads: ClientSlots | None) -> bytes | GatewayError | None:
    """`_read_body`, unless as many bodies as the caps allow are being read (the refusal then).
    A small body declared as such is not counted: a burst of hundreds of text requests is read
    in a moment, and holds next to nothing while it is."""
    weight = _most(scope, settings.GATEWAY_MAX_BODY_BYTES)
    if body_reads is None or weight <= SMALL_BODY:
        return await _read_body(receive)
    client = client_address(scope)
    cap = body_reads.take(client, overall=settings.HTTP_MAX_BODY_READS,
                          per_client=settings.HTTP_MAX_BODY_READS_PER_CLIENT, weight=weight,
                          overall_weight=settings.HTTP_MAX_BODY_READ_MB << 20)
    if cap is not None:
        return _busy(cap)
    try:
        return await _read_body(receive, _declared(scope))
    finally:
        body_reads.give_back(client, weight)


def _declared(scope) -> int | None:
    """A request's declared body length, if it has one."""
    declared = dict(scope.get("headers", [])).get(b"content-length", b"")
    return int(declared) if declared.isdigit() else None


def _most(scope, limit: int) -> int:
    """The most a request's body may grow to: its declared length, else the limit."""
    declared = _declared(scope)
    return limit if declared is None else min(declared, limit)


def _busy(cap: Cap) -> GatewayError:
    retry = {"Retry-After": str(BUSY_RETRY_AFTER_S)}
    if cap == "client":
        return GatewayError(429, "this address is sending as many request bodies at once as it may; "
                            "retry shortly", code="rate_limit_exceeded", headers=retry)
    return GatewayError(503, "the gateway is reading as many request bodies at once as it can; retry shortly",
                        code="service_unavailable", headers=retry)


def _declares_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0") != "0" or "transfer-encoding" in headers


async def _checked_before_body(path: str, method: str, headers: dict[str, str]) -> Response | state.KeyInfo:
    """What is answered before any of the body is read (an unknown path, a wrong method, a
    missing, unknown or unusable key, a body declared too large: the response); otherwise the
    caller's key."""
    route = ROUTES.get(path)
    if route is None:
        return await handlers.not_found(Request(method=method, headers=headers, body=b""), path.removeprefix("/v1/"))
    if method != route[0]:
        return error_response(405, f"{method} is not allowed on {path}", headers={"Allow": route[0]})
    return await handlers.check_before_body(headers, chat=route[1] is handlers.chat_completions)


async def _send(send, response: Response, *, close: bool = False) -> None:
    """`response` sent; with `close`, as the connection's last (a body left unread is not waited for)."""
    headers = [(b"content-type", response.content_type.encode())]
    if close:
        headers.append((b"connection", b"close"))
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
            # Built before the first request, not by it; told to stop, it stops as stopping.py says.
            current_process().stopping.install(asyncio.get_running_loop(), delay_s=settings.SHUTDOWN_DELAY_S,
                                               grace_s=settings.SHUTDOWN_GRACE_S)
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await settle()  # the requests cut when the grace ran out hand their usage over
            await handlers.drain()
            await current_process().connections.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope, receive, send, *, body_reads: ClientSlots | None = None) -> None:
    """The gateway's front; `body_reads` counts the request bodies being read (None: uncounted)."""
    path, method, arrived = scope["path"], scope["method"], time.monotonic()
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    unread = _declares_body(headers)
    # Nobody without a key, nor on a path or method that takes no body, makes the gateway
    # buffer megabytes or wait for them.
    key = await _checked_before_body(path, method, headers)
    if isinstance(key, Response):
        await _send(send, key, close=unread)
        return
    handler, body = ROUTES[path][1], b""
    if unread and method == "POST":  # a body sent with a GET is not read
        body = await _read_body_within_caps(scope, receive, body_reads)
        if body is None:
            return
        if isinstance(body, GatewayError):  # its key is known: the refusal is its tenant's to see
            await _send(send, await handlers.refused(handlers.new_request_id(), body, key, arrived), close=True)
            return
        unread = False
    await _connection_hygiene()
    request = Request(method=method, headers=headers, body=body, key=key)

    async def respond():
        await _send(send, await handler(request), close=unread)

    async def client_left():
        while (await receive())["type"] != "http.disconnect":
            pass

    # A client that leaves cancels the work done for it (the handlers record it as aborted).
    work, watch = answering(respond()), asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()
        else:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    except asyncio.CancelledError:
        # The server cut the request, its grace over: the work for it ends too, handing its usage
        # over on its way out (before the process exits: lifespan), not left running unseen, and
        # recorded as cut by the gateway rather than left by its client.
        stopping = current_process().stopping
        stopping.cutting = stopping.asked_at is not None
        work.cancel()
        raise
    except Exception:
        log.exception("gateway failure on %s", path)
        try:
            await _send(send, error_response(500, "the gateway failed on this request", code="internal_error"))
        except Exception:  # noqa: BLE001 - the response had already started
            pass
    finally:
        watch.cancel()
