"""Pooled HTTP connections to engines, and the choice of instance."""

from __future__ import annotations

import random
from collections import defaultdict

import httpx
from django.conf import settings

from controlplane.gateway.state import InstanceSpec

_client: httpx.AsyncClient | None = None
# Requests this process has in flight per instance: the least-outstanding-work signal.
outstanding: defaultdict[int, int] = defaultdict(int)


def client() -> httpx.AsyncClient:
    global _client
    if _client is None or _client.is_closed:
        _client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.GATEWAY_UPSTREAM_TIMEOUT, connect=3.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )
    return _client


def choose(candidates: list[InstanceSpec], *, exclude: set[int] = frozenset()) -> InstanceSpec | None:
    pool = [c for c in candidates if c.id not in exclude]
    if not pool:
        return None
    least = min(outstanding[c.id] for c in pool)
    return random.choice([c for c in pool if outstanding[c.id] == least])
