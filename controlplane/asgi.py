"""The ASGI application: /v1 goes to the gateway's lean ASGI front, everything else to Django."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

django_application = get_asgi_application()

from controlplane.gateway.asgi import app as gateway_application  # noqa: E402 - needs Django set up


async def application(scope, receive, send):
    if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
        return await gateway_application(scope, receive, send)
    return await django_application(scope, receive, send)
