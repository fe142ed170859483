"""Which engine gets a request.

- Isolation: a request whose image tokens exceed the tier's large-image threshold goes to
  the tier's large-image pool when it has one, and other requests never do; without a
  dedicated pool, large requests share the standard engines under the tier's cap of large
  images in prefill (prefill.py, with every image request's slots on its engine).
- Least outstanding work among healthy engines: every replica's requests in flight (each
  tells the others through Redis) plus the engine's own running and waiting requests from
  its last scrape.
- Affinity: a picture prefers the engines in an order every replica computes alike
  (rendezvous hashing), so the next turn of a chat reaches the engine that encoded its image
  whichever replica takes it; it goes there while that engine's load is within
  AFFINITY_SLACK of the least.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

import orjson
import xxhash
from django.conf import settings

from controlplane.gateway import state
from controlplane.gateway.apps import current_process
from controlplane.gateway.prepare import Prepared, TierSpec
from controlplane.gateway.state import InstanceSpec, read_or_unavailable
from controlplane.redis_clients import async_redis, key_prefix

log = logging.getLogger(__name__)

AFFINITY_SLACK = 2
LOADS_EVERY_S = 0.5  # how often a replica tells the others its requests in flight, and reads theirs
LOADS_STALE_S = 3.0  # a replica not heard from for this long has none (it stopped or died)


def affinity_order(image: str, engines: list[InstanceSpec]) -> list[InstanceSpec]:
    """The engines in the order a picture prefers them: rendezvous (highest random weight)
    hashing of its key with each engine's id. Every replica computes the same order without
    asking the others, and an engine that joins or leaves moves only the pictures it wins."""
    return sorted(engines, key=lambda c: xxhash.xxh64_intdigest(f"{image}|{c.id}"), reverse=True)


class EngineLoads:
    """One process's view of its engines' loads: its own requests in flight on each, and every
    other replica's as they last told it (through Redis, every LOADS_EVERY_S: `refresh`). Kept
    by its GatewayProcess."""

    def __init__(self, shared: SharedLoads | None = None):
        self.outstanding: defaultdict[int, int] = defaultdict(int)  # this process's requests in flight
        self.others: dict[int, int] = {}  # the other replicas' requests in flight, by engine
        self.shared = shared

    async def refresh(self) -> None:
        """The other replicas' loads, when they are due to be read again."""
        if self.shared is not None:
            await self.shared.exchange_when_due(self)

    def load(self, engine: InstanceSpec) -> float:
        return self.outstanding[engine.id] + self.others.get(engine.id, 0) + engine.queued

    def ranked(self, candidates: list[InstanceSpec], *, exclude=frozenset(), large: bool = False,
               images: tuple[str, ...] = ()) -> list[InstanceSpec]:
        """The engines that may take the request, the one to prefer first. A request with
        pictures: the engines in its first picture's affinity order (the one that encoded it
        has it in its encoder and prefix caches) while their load is within AFFINITY_SLACK of
        the least (bounded loads: a picture's engine is not worth a long wait); then, and for
        text, the least loaded (ties in random order)."""
        dedicated = [c for c in candidates if c.pool == "large"]
        if large and dedicated:  # isolated: never spill into the standard engines, even on a retry
            pool = [c for c in dedicated if c.id not in exclude]
        else:
            pool = [c for c in candidates if c.pool != "large" and c.id not in exclude]
        if not pool:
            return []
        load = {c.id: self.load(c) for c in pool}
        order = sorted(pool, key=lambda c: (load[c.id], random.random()))
        if not images:
            return order
        bound = load[order[0].id] + AFFINITY_SLACK
        warm = [c for c in affinity_order(images[0], pool) if load[c.id] <= bound]
        return warm + [c for c in order if c not in warm]

    def choose(self, candidates: list[InstanceSpec], **how) -> InstanceSpec | None:
        ranked = self.ranked(candidates, **how)
        return ranked[0] if ranked else None


class SharedLoads:
    """Each replica's requests in flight by engine, in one Redis hash (a field a replica, with
    the time it wrote it), so that least-outstanding counts every replica's requests: written
    and read together, in one round trip, by the first request routed after LOADS_EVERY_S."""

    def __init__(self, url: str, prefix: str):
        self.url, self.key = url, f"{prefix}:engine-loads"
        self.replica = uuid.uuid4().hex
        self._due = 0.0  # when the next exchange is due (monotonic)

    @classmethod
    def from_settings(cls) -> SharedLoads | None:
        """None in embedded mode, where one process serves every request."""
        return cls(settings.REDIS_URL, key_prefix()) if settings.REDIS_URL else None

    async def exchange_when_due(self, loads: EngineLoads) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + LOADS_EVERY_S  # also while this one runs, and after one that failed
        try:
            await self.exchange(loads)
        except Exception as exc:  # noqa: BLE001 - Redis away: this replica's own loads, and the engines'
            log.debug("could not share engine loads: %s", exc)
            loads.others = {}

    async def exchange(self, loads: EngineLoads) -> None:
        """Tell the others this replica's loads, and read theirs, in one round trip."""
        now = time.time()
        mine = orjson.dumps({"t": now, "loads": {str(k): v for k, v in loads.outstanding.items() if v}})
        client = async_redis(self.url)
        async with client.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, self.replica, mine)
            pipe.expire(self.key, int(LOADS_STALE_S * 10))
            pipe.hgetall(self.key)
            *_, fields = await pipe.execute()
        others: defaultdict[int, int] = defaultdict(int)
        for replica, raw in fields.items():
            told = orjson.loads(raw)
            if replica.decode() == self.replica or now - told["t"] > LOADS_STALE_S:
                continue
            for engine, count in told["loads"].items():
                others[int(engine)] += count
        loads.others = dict(others)


def has_dedicated_large_pool(candidates: list[InstanceSpec]) -> bool:
    return any(c.pool == "large" for c in candidates)


@dataclass(frozen=True)
class Route:
    candidates: list
    large: bool
    images: tuple[str, ...]  # the keys of its images' bytes, by which engines are preferred
    # The engine chosen before admission, journaled with it: one round trip to the ledger
    # fewer. An image request may be sent to another, the first of its engines to have a
    # prefill slot free.
    first: object = None


async def route_request(key: state.KeyInfo, tier: TierSpec, prepared: Prepared) -> Route:
    candidates = await read_or_unavailable("the engines", state.instances(tier.id))
    await current_process().engines.refresh()
    large = prepared.image_tokens > tier.large_image_threshold
    # Per tenant: one tenant's requests never steer toward the engine holding another's images.
    images = tuple(f"{key.tenant_id}:{p.key}" for p in prepared.images)
    first = current_process().engines.choose(candidates, large=large, images=images)
    return Route(candidates, large, images, first)
