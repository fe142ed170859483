"""Which engine gets a request.

- Isolation: a request whose image tokens exceed the tier's large-image threshold goes to
  the tier's large-image pool when it has one, and other requests never do; without a
  dedicated pool, large requests share the standard engines under the tier's cap of large
  images in prefill (prefill.py, with every image request's slots on its engine).
- Least outstanding work among healthy engines: this process's requests in flight plus the
  engine's own running and waiting requests from its last scrape.
- Affinity: an engine that recently encoded the same picture has it in its encoder and
  prefix caches; it is preferred while its load is within AFFINITY_SLACK of the least.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from controlplane.gateway import state
from controlplane.gateway.apps import current_process
from controlplane.gateway.prepare import Prepared, TierSpec
from controlplane.gateway.state import InstanceSpec, read_or_unavailable

AFFINITY_SLACK = 2
AFFINITY_ITEMS = 20_000

class EngineLoads:
    """One process's view of its engines: its requests in flight on each, and which engine last
    encoded each picture. Kept by its GatewayProcess."""

    def __init__(self):
        self.outstanding: defaultdict[int, int] = defaultdict(int)  # this process's requests in flight
        self._affinity: OrderedDict[str, int] = OrderedDict()  # an image's key -> engine last sent it
        self._lock = threading.Lock()

    def ranked(self, candidates: list[InstanceSpec], *, exclude=frozenset(), large: bool = False,
               images: tuple[str, ...] = ()) -> list[InstanceSpec]:
        """The engines that may take the request, the one to prefer first: the one that last
        took one of its pictures, while its load is within AFFINITY_SLACK of the least; then
        the least loaded (ties in random order)."""
        dedicated = [c for c in candidates if c.pool == "large"]
        if large and dedicated:  # isolated: never spill into the standard engines, even on a retry
            pool = [c for c in dedicated if c.id not in exclude]
        else:
            pool = [c for c in candidates if c.pool != "large" and c.id not in exclude]
        if not pool:
            return []
        load = {c.id: self.outstanding[c.id] + c.queued for c in pool}
        order = sorted(pool, key=lambda c: (load[c.id], random.random()))
        least = load[order[0].id]
        with self._lock:
            warm = [self._affinity.get(image) for image in images]
        for instance_id in warm:
            if instance_id in load and load[instance_id] <= least + AFFINITY_SLACK:
                return [c for c in order if c.id == instance_id] + [c for c in order if c.id != instance_id]
        return order

    def choose(self, candidates: list[InstanceSpec], **how) -> InstanceSpec | None:
        ranked = self.ranked(candidates, **how)
        return ranked[0] if ranked else None

    def remember(self, images: tuple[str, ...], instance_id: int) -> None:
        with self._lock:
            for image in images:
                self._affinity[image] = instance_id
                self._affinity.move_to_end(image)
            while len(self._affinity) > AFFINITY_ITEMS:
                self._affinity.popitem(last=False)


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
    large = prepared.image_tokens > tier.large_image_threshold
    # Per tenant: one tenant's requests never steer toward the engine holding another's images.
    images = tuple(f"{key.tenant_id}:{p.key}" for p in prepared.images)
    first = current_process().engines.choose(candidates, large=large, images=images)
    return Route(candidates, large, images, first)
