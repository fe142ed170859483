"""What one gateway process holds while it serves, in one object: the prepared-image cache,
the memory its decodes may hold, its caches of the database, its engines' loads and turns,
what its admissions taught it, its counters, its requests in the ledger, the usage
hand-overs still running, and the refusals it kept or counted (refusals.py). Built once a
process (`apps.current_process`); a test builds a fresh one instead of resetting module state.
Nothing here is shared between replicas: what must be is in Redis."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field

from django.conf import settings

from controlplane.gateway.admission import OptimisticAdmission
from controlplane.gateway.counters import Counters
from controlplane.gateway.ledger import LedgerBook
from controlplane.gateway.prefill import PrefillSlots
from controlplane.gateway.prepare import Seen
from controlplane.gateway.refusals import KeylessTally, RecordedRefusals
from controlplane.gateway.repeats import Repeats, Shared
from controlplane.gateway.routing import EngineLoads, SharedLoads
from controlplane.gateway.state import Caches
from controlplane.gateway.stopping import Stopping
from controlplane.gateway.upstream import Connections
from controlplane.imaging.budget import MB, DecodeMemory
from controlplane.imaging.fingerprint import FingerprintIndex
from controlplane.imaging.resample import CORES
from controlplane.threads import Threads


@dataclass(eq=False)
class GatewayProcess:
    prepared_images: Repeats  # what pictures sent before became, for the requests that send them again
    decode_memory: DecodeMemory  # what this process's decodes may hold at once
    caches: Caches
    engines: EngineLoads
    optimistic: OptimisticAdmission
    counters: Counters
    prefill: PrefillSlots  # image requests' turns on the engines, shared by every replica
    hand_overs: set[asyncio.Task] = field(default_factory=set)  # usage on its way to the ledger
    answering: set[asyncio.Task] = field(default_factory=set)  # requests being answered (recording.settle)
    tier_names: dict[int, str] = field(default_factory=dict)  # for the counters
    engine_watches: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # loop -> watch
    ledger_book: LedgerBook = field(default_factory=LedgerBook)  # its requests in the ledger, its stores
    # Re-encodings of a picture this process has seen get that picture's fingerprint; the checks
    # of images sent as they came start from the intake's own thread as soon as it knows (one
    # thread per core: a check never waits behind another request's intake).
    seen: Seen = field(default_factory=lambda: Seen(FingerprintIndex(), Threads("checks", CORES)))
    connections: Connections = field(default_factory=Connections)  # pooled, to engines and other services
    connections_checked_at: float = 0.0  # when the database connection was last checked (monotonic)
    stopping: Stopping = field(default_factory=Stopping)  # told to stop: unready, streams ending (stopping.py)
    recorded_refusals: RecordedRefusals = field(default_factory=RecordedRefusals)  # of unusable keys (refusals.py)
    keyless: KeylessTally | None = None  # requests refused with no key of ours, for the overview (refusals.py)

    @classmethod
    def from_settings(cls) -> GatewayProcess:
        counters = Counters()
        return cls(
            prepared_images=Repeats(settings.GATEWAY_REPEATS_MB * MB, shared=Shared.from_settings(counters)),
            decode_memory=DecodeMemory(settings.GATEWAY_DECODE_MEMORY_MB * MB,
                                       wait_s=settings.GATEWAY_DECODE_WAIT_MS / 1000,
                                       decodes=settings.GATEWAY_DECODES_AT_ONCE),
            caches=Caches(), engines=EngineLoads(SharedLoads.from_settings()), optimistic=OptimisticAdmission(), counters=counters,
            prefill=PrefillSlots.from_settings(), keyless=KeylessTally.from_settings())
