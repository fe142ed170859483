"""Pooled HTTP connections to engines, and the choice of instance."""

from __future__ import annotations

import asyncio
import random
import weakref
from collections import defaultdict

import httpx
from django.conf import settings

from controlplane.gateway.state import InstanceSpec

# One pooled client per event loop (a server has one loop; tests may run several).
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Requests this process has in flight per instance: the least-outstanding-work signal.
outstanding: defaultdict[int, int] = defaultdict(int)


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


def choose(candidates: list[InstanceSpec], *, exclude: set[int] = frozenset()) -> InstanceSpec | None:
    pool = [c for c in candidates if c.id not in exclude]
    if not pool:
        return None
    # Least outstanding work: this process's requests in flight, plus what the engine itself
    # reported queued at its last scrape (other gateway replicas' work shows up there).
    load = {c.id: outstanding[c.id] + c.queued for c in pool}
    least = min(load.values())
    return random.choice([c for c in pool if load[c.id] == least])
