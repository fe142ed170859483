"""The ASGI application: /v1 goes to the gateway's lean ASGI front, everything else to Django,
with bounds on a request body's size, on how long it may take to arrive, and on how many are
read at once."""

import asyncio
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

django_application = get_asgi_application()

from django.conf import settings  # noqa: E402 - needs Django set up

from controlplane.client_slots import ClientSlots, client_address  # noqa: E402
from controlplane.gateway.apps import current_process  # noqa: E402
from controlplane.gateway.asgi import (  # noqa: E402
    BUSY_RETRY_AFTER_S,
    SMALL_BODY,  # noqa: E402
    lifespan,
)
from controlplane.gateway.asgi import app as gateway_application  # noqa: E402


class Application:
    """The ASGI application; one per server process, holding what it counts across requests."""

    def __init__(self) -> None:
        self.body_reads = ClientSlots("request bodies being read")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] == "http" and scope["path"] == READINESS:
            return await _readiness(send)
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            return await gateway_application(scope, receive, send, body_reads=self.body_reads)
        if scope["type"] == "http":
            return await self._page(scope, receive, send)
        return await django_application(scope, receive, send)

    async def _page(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > settings.WEB_MAX_BODY_BYTES:
            return await _refuse(send, 413, f"request body exceeds {settings.WEB_MAX_BODY_BYTES} bytes")
        client, counted = client_address(scope), declared not in (b"", b"0") or b"transfer-encoding" in headers
        counted = counted and not (declared.isdigit() and int(declared) <= SMALL_BODY)  # as the gateway's
        weight = min(int(declared), settings.WEB_MAX_BODY_BYTES) if declared.isdigit() else settings.WEB_MAX_BODY_BYTES
        if counted:
            cap = self.body_reads.take(client, overall=settings.HTTP_MAX_BODY_READS,
                                       per_client=settings.HTTP_MAX_BODY_READS_PER_CLIENT, weight=weight,
                                       overall_weight=settings.HTTP_MAX_BODY_READ_MB << 20)
            if cap is not None:
                return await _refuse(send, *_BUSY[cap], [(b"retry-after", str(BUSY_RETRY_AFTER_S).encode())])
        body = _PageBody(receive, settings.WEB_MAX_BODY_BYTES, settings.GATEWAY_BODY_TIMEOUT_S,
                         on_end=(lambda: self.body_reads.give_back(client, weight)) if counted else None)
        answered = False

        async def watched(message):
            nonlocal answered
            answered = True
            await send(message)

        try:
            await django_application(scope, body.receive, watched)
        finally:
            body.end()
        if body.refusal is not None and not answered:
            await _refuse(send, *body.refusal)


application = Application()
_BUSY = {"client": (429, "too many request bodies from this address at once; retry shortly"),
         "overall": (503, "too many request bodies at once; retry shortly")}


READINESS = "/readyz"


async def _readiness(send) -> None:
    """For load balancers: 200 while this process takes new work; 503 from the moment it is told
    to stop (it still serves what comes meanwhile: gateway/stopping.py). Nothing else is
    checked: a database or Redis that is down is answered per request, by every replica alike."""
    ready = current_process().stopping.ready
    await send({"type": "http.response.start", "status": 200 if ready else 503,
                "headers": [(b"content-type", b"text/plain"), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b"ready\n" if ready else b"stopping\n"})


async def _refuse(send, status: int, message: str, headers: tuple = ()) -> None:
    """A plain answer that ends the connection (a body left unread is not waited for)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": f"{message}\n".encode()})


class _PageBody:
    """A page's `receive`, as a client that sends more than `limit` bytes of body, or takes
    longer than `seconds` to send it, leaving: Django stops reading and answers nothing
    (rather than spooling any size to disk, or waiting as long as the client likes), and
    `refusal` says what to answer instead."""

    def __init__(self, receive, limit: int, seconds: float, on_end=None):
        self._receive, self._limit, self._seconds, self._on_end = receive, limit, seconds, on_end
        self._deadline = asyncio.get_running_loop().time() + seconds
        self._size, self._ended = 0, False
        self.refusal: tuple[int, str] | None = None

    async def receive(self):
        if self._ended:  # Django now only listens for the client leaving
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            return self._refuse(408, f"the request body did not arrive within {self._seconds}s")
        if message["type"] == "http.request":
            self._size += len(message.get("body", b""))
            if self._size > self._limit:
                return self._refuse(413, f"request body exceeds {self._limit} bytes")
            if not message.get("more_body", False):
                self.end()
        else:
            self.end()
        return message

    def end(self) -> None:
        """The body is read, refused or abandoned: `on_end` is called, once."""
        if not self._ended:
            self._ended = True
            if self._on_end is not None:
                self._on_end()

    def _refuse(self, status: int, message: str) -> dict:
        self.refusal = (status, message)
        self.end()
        return {"type": "http.disconnect"}
