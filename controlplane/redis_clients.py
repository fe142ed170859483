"""Async Redis clients, one per event loop (a server has one loop; tests may run several)."""

from __future__ import annotations

import asyncio
import weakref

import redis.asyncio as redis

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def async_redis(url: str) -> redis.Redis:
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(url)
    if client is None:
        client = per_loop[url] = redis.Redis.from_url(url)
    return client


def key_prefix() -> str:
    """Where this deployment's keys live in a shared Redis (CACHE_KEY_PREFIX)."""
    from django.conf import settings

    return settings.CACHES["default"].get("KEY_PREFIX", "vlmcp")
