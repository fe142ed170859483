"""The gateway's handlers as Django views: the way in for Django's test client, and for a
deployment that serves /v1 through Django. Production serves /v1 through gateway/asgi.py."""

from __future__ import annotations

import asyncio

from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.gateway import handlers
from controlplane.gateway.http import Request, Response


def _request(request) -> Request:
    try:
        body = request.body
    except RequestDataTooBig:
        body = None
    return Request(method=request.method, headers={k.lower(): v for k, v in request.headers.items()}, body=body)


def _django(response: Response):
    if response.stream is not None:
        django_response = StreamingHttpResponse(response.stream, status=response.status,
                                                content_type=response.content_type)
        if response.on_close is not None:
            loop = asyncio.get_running_loop()
            # Django closes responses from a thread; the close itself belongs on this loop.
            django_response._resource_closers.append(
                lambda: asyncio.run_coroutine_threadsafe(response.on_close(), loop))
    else:
        django_response = HttpResponse(response.body, status=response.status, content_type=response.content_type)
    for name, value in response.headers.items():
        django_response[name] = value
    return django_response


@csrf_exempt
async def models(request):
    return _django(await handlers.models(_request(request)))


@csrf_exempt
async def chat_completions(request):
    return _django(await handlers.chat_completions(_request(request)))


@csrf_exempt
async def not_found(request, path=""):
    return _django(await handlers.not_found(_request(request), path))
