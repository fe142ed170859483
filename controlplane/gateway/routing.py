"""Which engine gets a request.

- Isolation: a request whose image tokens exceed the tier's large-image threshold goes to
  the tier's large-image pool when it has one, and other requests never do; without a
  dedicated pool, large requests share the standard engines under a concurrency cap
  (`large_slots`), so a burst of large images cannot fill every batch; the slots go round
  the tenants waiting for one, and a request waits for one only so long.
- Least outstanding work among healthy engines: this process's requests in flight plus the
  engine's own running and waiting requests from its last scrape.
- Affinity: an engine that recently encoded the same picture has it in its encoder and
  prefix caches; it is preferred while its load is within AFFINITY_SLACK of the least.
"""

from __future__ import annotations

import asyncio
import random
import threading
import weakref
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

from controlplane.gateway import state
from controlplane.gateway.apps import current_process
from controlplane.gateway.prepare import Prepared, TierSpec
from controlplane.gateway.state import InstanceSpec, read_or_unavailable

AFFINITY_SLACK = 2
AFFINITY_ITEMS = 20_000

class EngineLoads:
    """One process's view of its engines: its requests in flight on each, which engine last
    encoded each picture, and the large-image turns of each tier. Kept by its GatewayProcess."""

    def __init__(self):
        self.outstanding: defaultdict[int, int] = defaultdict(int)  # this process's requests in flight
        self._affinity: OrderedDict[str, int] = OrderedDict()  # an image's key -> engine last sent it
        self._lock = threading.Lock()
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {tier: FairSlots}

    def choose(self, candidates: list[InstanceSpec], *, exclude=frozenset(), large: bool = False,
               images: tuple[str, ...] = ()) -> InstanceSpec | None:
        dedicated = [c for c in candidates if c.pool == "large"]
        if large and dedicated:  # isolated: never spill into the standard engines, even on a retry
            pool = [c for c in dedicated if c.id not in exclude]
        else:
            pool = [c for c in candidates if c.pool != "large" and c.id not in exclude]
        if not pool:
            return None
        load = {c.id: self.outstanding[c.id] + c.queued for c in pool}
        least = min(load.values())
        with self._lock:
            warm = [self._affinity.get(image) for image in images]
        for instance_id in warm:
            if instance_id in load and load[instance_id] <= least + AFFINITY_SLACK:
                return next(c for c in pool if c.id == instance_id)
        return random.choice([c for c in pool if load[c.id] == least])

    def remember(self, images: tuple[str, ...], instance_id: int) -> None:
        with self._lock:
            for image in images:
                self._affinity[image] = instance_id
                self._affinity.move_to_end(image)
            while len(self._affinity) > AFFINITY_ITEMS:
                self._affinity.popitem(last=False)

    def large_slots(self, tier_id: int, size: int) -> FairSlots:
        """This process's cap on concurrent large-image requests of a tier without a large pool."""
        loop = asyncio.get_running_loop()
        per_loop = self._slots.setdefault(loop, {})
        slots = per_loop.get((tier_id, size))  # a new size (the tier was edited) gets new slots
        if slots is None:
            slots = per_loop[(tier_id, size)] = FairSlots(size)
        return slots


def has_dedicated_large_pool(candidates: list[InstanceSpec]) -> bool:
    return any(c.pool == "large" for c in candidates)


class FairSlots:
    """A process's large-image slots for a tier, handed out fairly: when requests wait, a freed
    slot goes to the tenant that has waited its turn (round robin over the tenants waiting,
    first come first served within each), so one tenant's burst cannot starve the others."""

    def __init__(self, size: int):
        self.size, self.held = size, 0
        self._waiting: OrderedDict[int, deque] = OrderedDict()  # tenant -> its waiters, in order

    async def acquire(self, tenant_id: int, *, timeout: float) -> None:
        """Take a slot within `timeout` seconds, or raise TimeoutError having taken none."""
        if self.held < self.size and not self._waiting:
            self.held += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant_id, deque()).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except (TimeoutError, asyncio.CancelledError):
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as it gave up: pass it on
            else:
                waiter.cancel()
                self._forget(tenant_id, waiter)
            raise

    def release(self) -> None:
        while self._waiting:
            tenant_id, waiters = next(iter(self._waiting.items()))
            waiter = waiters.popleft()
            if waiters:
                self._waiting.move_to_end(tenant_id)  # this tenant's next waits for the others
            else:
                del self._waiting[tenant_id]
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to it
                return
        self.held -= 1

    def _forget(self, tenant_id: int, waiter) -> None:
        waiters = self._waiting.get(tenant_id)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiting[tenant_id]


@dataclass(frozen=True)
class Route:
    candidates: list
    large: bool
    images: tuple[str, ...]  # the keys of its images' bytes, by which engines are preferred
    # The engine chosen before admission, journaled with it: one round trip to the ledger
    # fewer. None when a large image must wait for its turn first (chosen after the wait).
    first: object = None


async def route_request(key: state.KeyInfo, tier: TierSpec, prepared: Prepared) -> Route:
    candidates = await read_or_unavailable("the engines", state.instances(tier.id))
    large = prepared.image_tokens > tier.large_image_threshold
    # Per tenant: one tenant's requests never steer toward the engine holding another's images.
    images = tuple(f"{key.tenant_id}:{p.key}" for p in prepared.images)
    waits = large and not has_dedicated_large_pool(candidates)
    first = None if waits else current_process().engines.choose(candidates, large=large, images=images)
    return Route(candidates, large, images, first)
