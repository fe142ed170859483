"""The project's middleware, each async-capable.

Django runs a middleware that is not async-capable in sync mode, and a sync middleware in
front of an async view makes every request pass through one shared thread: under uvicorn
the gateway would serve one request at a time. WhiteNoise's middleware is sync-only, so it
is wrapped here: static files are answered from the sync part, everything else is awaited.
"""

from __future__ import annotations

import asyncio
from urllib.parse import unquote_to_bytes

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponseBadRequest, JsonResponse
from django.utils.decorators import sync_and_async_middleware
from whitenoise.middleware import WhiteNoiseMiddleware

from controlplane.tenants import roles
from controlplane.tenants.forms import TENANT_DEACTIVATED


@sync_and_async_middleware
def unreadable_address_refusal(get_response):
    """A 400 for an address no page can read: a NUL byte in its path or query string (which
    the database refuses and no header may carry), or a query string that is not UTF-8 once
    its %-escapes are decoded (which Django would quietly turn into other characters)."""
    if iscoroutinefunction(get_response):
        async def middleware(request):
            return _unreadable_address(request) or await get_response(request)
    else:
        def middleware(request):
            return _unreadable_address(request) or get_response(request)
    return middleware


def _unreadable_address(request):
    query = unquote_to_bytes(request.META.get("QUERY_STRING", ""))
    if "\x00" in request.path_info:
        message = "the address holds a NUL byte (%00), which no page has in its path"
    elif b"\x00" in query:
        message = "the query string holds a NUL byte (%00), which no parameter may contain"
    else:
        try:
            query.decode("utf-8")
            return None
        except UnicodeDecodeError:
            message = "the query string is not UTF-8 once its %-escapes are decoded"
    if request.path_info.startswith("/v1/"):
        return JsonResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "unreadable_address"}}, status=400)
    if request.path_info.startswith("/api/"):
        return JsonResponse({"detail": message}, status=400)
    return HttpResponseBadRequest(f"{message[0].upper()}{message[1:]}.\n", content_type="text/plain; charset=utf-8")


@sync_and_async_middleware
def deactivated_tenant_sign_out(get_response):
    """Ends the session of a tenant admin whose tenant was deactivated after they logged in:
    their next page is the login page, saying why (an API call is a 403)."""
    if iscoroutinefunction(get_response):
        async def middleware(request):
            return await sync_to_async(_signed_out)(request) or await get_response(request)
    else:
        def middleware(request):
            return _signed_out(request) or get_response(request)
    return middleware


def _signed_out(request):
    if not request.user.is_authenticated or (tenant := roles.deactivated_tenant(request.user)) is None:
        return None
    logout(request)
    message = TENANT_DEACTIVATED.format(tenant=tenant.name)
    if request.path_info.startswith("/api/"):
        return JsonResponse({"detail": message}, status=403)
    messages.error(request, message)
    return redirect_to_login(request.get_full_path())


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None):
        super().__init__(get_response)
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def _static_file(self, request):
        if self.autorefresh:
            return self.find_file(request.path_info)
        return self.files.get(request.path_info)

    def __call__(self, request):
        if self._async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request):
        if request.path_info.startswith(self.static_prefix or "/static/"):
            static_file = await sync_to_async(self._static_file, thread_sensitive=False)(request)
            if static_file is not None:
                response = await sync_to_async(self.serve, thread_sensitive=False)(static_file, request)
                if response.streaming and not response.is_async:
                    # Django would read a synchronous file iterator into memory first (plotly.js
                    # is 4.5 MB); hand it chunks read on a worker thread instead.
                    response.streaming_content = _chunks(iter(response.streaming_content))
                return response
        return await self.get_response(request)


async def _chunks(iterator):
    while (chunk := await asyncio.to_thread(next, iterator, None)) is not None:
        yield chunk
