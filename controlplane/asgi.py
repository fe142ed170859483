"""The ASGI application: /v1 goes to the gateway's lean ASGI front, everything else to Django,
with a bound on the size of a request body and on how long it may take to arrive."""

import asyncio
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

django_application = get_asgi_application()

from django.conf import settings  # noqa: E402 - needs Django set up

from controlplane.gateway.asgi import app as gateway_application  # noqa: E402
from controlplane.gateway.asgi import lifespan  # noqa: E402


class Application:
    """The ASGI application; one per server process, holding what it counts across requests."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            return await gateway_application(scope, receive, send)
        if scope["type"] == "http":
            declared = dict(scope.get("headers", [])).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > settings.WEB_MAX_BODY_BYTES:
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]})
                await send({"type": "http.response.body",
                            "body": f"request body exceeds {settings.WEB_MAX_BODY_BYTES} bytes\n".encode()})
                return
            receive = _bounded(receive, settings.WEB_MAX_BODY_BYTES, settings.GATEWAY_BODY_TIMEOUT_S)
        return await django_application(scope, receive, send)


application = Application()


def _bounded(receive, limit: int, seconds: float):
    """`receive`, as a client that sends more than `limit` bytes of body, or takes longer than
    `seconds` to send it, leaving: Django stops reading and answers nothing (rather than
    spooling any size to disk, or waiting as long as the client likes)."""
    loop = asyncio.get_running_loop()
    deadline, size, body_done = loop.time() + seconds, 0, False

    async def bounded():
        nonlocal size, body_done
        if body_done:  # Django now only listens for the client leaving
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                return {"type": "http.disconnect"}
            body_done = not message.get("more_body", False)
        return message

    return bounded
