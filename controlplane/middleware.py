"""Middleware that keeps the ASGI path asynchronous.

Django runs a middleware that is not async-capable in sync mode, and a sync middleware in
front of an async view makes every request pass through one shared thread: under uvicorn
the gateway would serve one request at a time. WhiteNoise's middleware is sync-only, so it
is wrapped here: static files are answered from the sync part, everything else is awaited.
"""

from __future__ import annotations

import asyncio

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


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
