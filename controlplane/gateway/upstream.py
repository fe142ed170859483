"""Pooled HTTP connections to engines."""

from __future__ import annotations

import asyncio
import weakref

import httpx
from django.conf import settings

# One pooled client per event loop (a server has one loop; tests may run several).
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    pooled = _clients.get(loop)
    if pooled is None or pooled.is_closed:
        pooled = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.GATEWAY_UPSTREAM_TIMEOUT, connect=3.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )
        _clients[loop] = pooled
    return pooled
