"""Image prefill slots: at most N image requests of an engine between their dispatch and their
first token, and at most L large-image requests of a tier in prefill at once, whatever the
number of gateway replicas.

An image's prefill is tens of times a text request's; an engine that takes several at once
makes every text request beside them wait (the remedy of the serving literature: one or two
image requests a batch). So an image request takes a slot on its engine before it is sent,
and gives it back with its first token (or its error, its client leaving, its failover).

The slots live in Redis, where every replica sees them: one sorted set of holders per engine
and one for a tier's large images, each holder with a lease (its expiry time as its score),
so that a replica that dies while holding slots loses them within the lease. Requests that
find no slot wait in the tier's queue, one queue per tenant, and freed slots go round the
tenants waiting (first come, first served within each), so one tenant's burst cannot starve
the others; a waiter takes whichever of its engines frees a slot first, its preferred engine
(the one that has its image cached, or the least loaded) first. A wait is bounded: past it the
request is refused with a `429` and `Retry-After`, having taken nothing.

Every step (take, leave, release) is one Lua script, which also hands freed slots to the
waiters in turn; a waiter learns it was given one on its next look (at once, when the slot
was freed by its own process). Embedded mode, with no Redis, keeps the same state in the
process (`LocalSlots`), where the one process is every replica there is.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import redis.exceptions
from django.conf import settings

from controlplane.gateway.errors import GatewayError
from controlplane.gateway.ledger import redis_scripts
from controlplane.redis_clients import key_prefix, script_redis

LOOK_EVERY_S = 0.02  # how often a waiter looks whether a replica freed a slot for it

# ARGV: 1 the tier's key prefix, 2 now (ms), 3 lease (ms), 4 what ('take', 'leave', 'release'),
# 5 the holder, 6 its tenant, 7 its engines in order of preference (comma separated), 8 slots
# per engine, 9 '1' when it is large, 10 the tier's large-image slots, 11 when it stops waiting
# (ms), 12 the engine it holds (release), 13 until when it waits for its first engine alone
# (ms). Returns the engine granted (take), or 0.
SLOTS = """
local base, now, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keep = lease * 2
local function held(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end
local function free_engine(engines, per_engine, large, large_slots, patient_until)
  if large == '1' and held(base .. ':large') >= tonumber(large_slots) then return nil end
  for engine in string.gmatch(engines, '[^,]+') do
    if held(base .. ':engine:' .. engine) < tonumber(per_engine) then return engine end
    if now < tonumber(patient_until) then return nil end  -- its first engine alone, for now
  end
  return nil
end
local function hold(holder, engine, large)
  local key = base .. ':engine:' .. engine
  redis.call('ZADD', key, now + lease, holder)
  redis.call('PEXPIRE', key, keep)
  if large == '1' then
    redis.call('ZADD', base .. ':large', now + lease, holder)
    redis.call('PEXPIRE', base .. ':large', keep)
  end
end
local function let_go(holder, engine)
  redis.call('ZREM', base .. ':engine:' .. engine, holder)
  redis.call('ZREM', base .. ':large', holder)
end
-- Freed slots to the waiters, a tenant at a time in turn.
local function hand_out()
  local ring = base .. ':ring'
  local idle = 0
  while true do
    local tenants = redis.call('LLEN', ring)
    if tenants == 0 or idle >= tenants then return end
    local tenant = redis.call('LPOP', ring)
    local queue = base .. ':queue:' .. tenant
    local holder = redis.call('LINDEX', queue, 0)
    local moved = false
    if holder then
      local spec = redis.call('HGET', base .. ':waiting', holder)
      local waiter = spec and cjson.decode(spec)
      if not waiter or waiter.until_ms < now then  -- gone, or its process died waiting
        redis.call('LPOP', queue)
        redis.call('HDEL', base .. ':waiting', holder)
        moved = true
      else
        local engine = free_engine(waiter.engines, waiter.per_engine, waiter.large, waiter.large_slots,
                                   waiter.patient_until)
        if engine then
          hold(holder, engine, waiter.large)
          redis.call('LPOP', queue)
          redis.call('HDEL', base .. ':waiting', holder)
          redis.call('HSET', base .. ':granted', holder, engine)
          redis.call('PEXPIRE', base .. ':granted', keep)
          moved = true
        end
      end
    end
    if redis.call('LLEN', queue) > 0 then redis.call('RPUSH', ring, tenant) end
    if moved then idle = 0 else idle = idle + 1 end
  end
end
local what, holder, tenant = ARGV[4], ARGV[5], ARGV[6]
local queue = base .. ':queue:' .. tenant
if what == 'release' then
  let_go(holder, ARGV[12])
  hand_out()
  return 0
end
if what == 'leave' then
  local engine = redis.call('HGET', base .. ':granted', holder)
  if engine then
    redis.call('HDEL', base .. ':granted', holder)
    let_go(holder, engine)
  else
    redis.call('LREM', queue, 0, holder)
    redis.call('HDEL', base .. ':waiting', holder)
    if redis.call('LLEN', queue) == 0 then redis.call('LREM', base .. ':ring', 0, tenant) end
  end
  hand_out()
  return 0
end
hand_out()
local engine = redis.call('HGET', base .. ':granted', holder)
if engine then
  redis.call('HDEL', base .. ':granted', holder)
  return tonumber(engine)
end
if redis.call('HEXISTS', base .. ':waiting', holder) == 1 then return 0 end
-- Those waiting had their turn: a slot still free is one none of them can use.
engine = free_engine(ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[13])
if engine then
  hold(holder, engine, ARGV[9])
  return tonumber(engine)
end
redis.call('HSET', base .. ':waiting', holder, cjson.encode({engines = ARGV[7], per_engine = tonumber(ARGV[8]),
  large = ARGV[9], large_slots = tonumber(ARGV[10]), until_ms = tonumber(ARGV[11]),
  patient_until = tonumber(ARGV[13])}))
redis.call('PEXPIRE', base .. ':waiting', keep)
if redis.call('RPUSH', queue, holder) == 1 then redis.call('RPUSH', base .. ':ring', tenant) end
redis.call('PEXPIRE', queue, keep)
redis.call('PEXPIRE', base .. ':ring', keep)
return 0
"""


@dataclass(frozen=True)
class Ask:
    """A request's ask for a prefill slot."""

    tier_id: int
    tenant_id: int
    holder: str  # unique to the request's attempt
    engines: tuple[int, ...]  # its tier's engines that may take it, preferred first
    per_engine: int  # the tier's image requests in prefill at once per engine
    large: bool = False  # counts against the tier's large-image slots as well
    large_slots: int = 1
    # How long it waits for its first engine alone (the one whose caches hold its pictures)
    # before any of them will do: a prefill from the cache is nearly free.
    patience_ms: int = 0


def _ms() -> int:
    return int(time.time() * 1000)


class RedisSlots:
    """The slots of every replica, in Redis."""

    def __init__(self, url: str, prefix: str, *, lease_s: float):
        self.url, self.prefix, self.lease_ms = url, prefix, int(lease_s * 1000)

    def _base(self, tier_id: int) -> str:
        return f"{self.prefix}:prefill:{{{tier_id}}}"  # a tier's keys share one hash slot

    async def _call(self, ask: Ask, what: str, *, until_ms: int = 0, engine: int = 0, patient_until: int = 0) -> int:
        args = (self._base(ask.tier_id), _ms(), self.lease_ms, what, ask.holder, ask.tenant_id,
                ",".join(map(str, ask.engines)), ask.per_engine, "1" if ask.large else "0", ask.large_slots,
                until_ms, engine, patient_until)
        return int(await redis_scripts.run(script_redis(self.url), SLOTS, 0, *args))

    async def take(self, ask: Ask, until_ms: int, patient_until: int = 0) -> int:
        return await self._call(ask, "take", until_ms=until_ms, patient_until=patient_until)

    async def leave(self, ask: Ask) -> None:
        await self._call(ask, "leave")

    async def release(self, ask: Ask, engine: int) -> None:
        await self._call(ask, "release", engine=engine)

    async def holders(self, tier_id: int, engine: int) -> int:
        """How many hold a slot of this engine now (for operations and tests)."""
        client = script_redis(self.url)
        key = f"{self._base(tier_id)}:engine:{engine}"
        return int(await client.eval("redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1]) "
                                     "return redis.call('ZCARD', KEYS[1])", 1, key, _ms()))


@dataclass
class _Tier:
    holders: dict[int, dict[str, float]] = field(default_factory=dict)  # engine -> holder -> lease end
    large: dict[str, float] = field(default_factory=dict)
    queues: OrderedDict[int, deque] = field(default_factory=OrderedDict)  # tenant -> waiting asks, in turn
    waiting: dict[str, tuple[Ask, int, int]] = field(default_factory=dict)  # holder -> (ask, until, patient until)
    granted: dict[str, int] = field(default_factory=dict)


class LocalSlots:
    """The same slots in the process, for embedded mode (one process serves every request)."""

    def __init__(self, *, lease_s: float):
        self.lease_ms = int(lease_s * 1000)
        self._tiers: dict[int, _Tier] = {}

    def _held(self, holders: dict[str, float], now: int) -> int:
        for holder in [h for h, end in holders.items() if end < now]:
            del holders[holder]
        return len(holders)

    def _free_engine(self, tier: _Tier, ask: Ask, now: int, patient_until: int) -> int | None:
        if ask.large and self._held(tier.large, now) >= ask.large_slots:
            return None
        for engine in ask.engines:
            if self._held(tier.holders.setdefault(engine, {}), now) < ask.per_engine:
                return engine
            if now < patient_until:
                return None  # its first engine alone, for now
        return None

    def _hold(self, tier: _Tier, ask: Ask, engine: int, now: int) -> None:
        tier.holders.setdefault(engine, {})[ask.holder] = now + self.lease_ms
        if ask.large:
            tier.large[ask.holder] = now + self.lease_ms

    def _hand_out(self, tier: _Tier, now: int) -> None:
        idle = 0
        while tier.queues and idle < len(tier.queues):
            tenant, queue = next(iter(tier.queues.items()))
            del tier.queues[tenant]
            moved = False
            holder = queue[0]
            ask, until_ms, patient_until = tier.waiting.get(holder, (None, 0, 0))
            if ask is None or until_ms < now:
                queue.popleft()
                tier.waiting.pop(holder, None)
                moved = True
            elif (engine := self._free_engine(tier, ask, now, patient_until)) is not None:
                self._hold(tier, ask, engine, now)
                queue.popleft()
                del tier.waiting[holder]
                tier.granted[holder] = engine
                moved = True
            if queue:
                tier.queues[tenant] = queue  # to the end: the next tenant's turn
            idle = 0 if moved else idle + 1

    async def take(self, ask: Ask, until_ms: int, patient_until: int = 0) -> int:
        tier, now = self._tiers.setdefault(ask.tier_id, _Tier()), _ms()
        self._hand_out(tier, now)
        if ask.holder in tier.granted:
            return tier.granted.pop(ask.holder)
        if ask.holder in tier.waiting:
            return 0
        # Those waiting had their turn: a slot still free is one none of them can use.
        if (engine := self._free_engine(tier, ask, now, patient_until)) is not None:
            self._hold(tier, ask, engine, now)
            return engine
        tier.waiting[ask.holder] = (ask, until_ms, patient_until)
        tier.queues.setdefault(ask.tenant_id, deque()).append(ask.holder)
        return 0

    async def leave(self, ask: Ask) -> None:
        tier = self._tiers.setdefault(ask.tier_id, _Tier())
        engine = tier.granted.pop(ask.holder, None)
        if engine is not None:
            self._let_go(tier, ask.holder, engine)
        elif tier.waiting.pop(ask.holder, None) is not None:
            queue = tier.queues.get(ask.tenant_id)
            if queue is not None and ask.holder in queue:
                queue.remove(ask.holder)
                if not queue:
                    del tier.queues[ask.tenant_id]
        self._hand_out(tier, _ms())

    async def release(self, ask: Ask, engine: int) -> None:
        tier = self._tiers.setdefault(ask.tier_id, _Tier())
        self._let_go(tier, ask.holder, engine)
        self._hand_out(tier, _ms())

    def _let_go(self, tier: _Tier, holder: str, engine: int) -> None:
        tier.holders.get(engine, {}).pop(holder, None)
        tier.large.pop(holder, None)

    async def holders(self, tier_id: int, engine: int) -> int:
        tier = self._tiers.get(tier_id)
        return self._held(tier.holders.get(engine, {}), _ms()) if tier else 0


class PrefillSlots:
    """A gateway process's way to the slots: it waits for one, and wakes its own waiters at
    once when it frees one (another replica's frees are seen on the next look)."""

    def __init__(self, store: RedisSlots | LocalSlots):
        self.store = store
        self._freed: dict[int, asyncio.Event] = {}  # tier -> set when this process frees one of its slots

    @classmethod
    def from_settings(cls) -> PrefillSlots:
        lease_s = settings.GATEWAY_PREFILL_LEASE_S
        if settings.REDIS_URL:
            return cls(RedisSlots(settings.REDIS_URL, key_prefix(), lease_s=lease_s))
        return cls(LocalSlots(lease_s=lease_s))

    async def take(self, ask: Ask, *, wait_s: float) -> Slot:
        """A slot on one of `ask.engines`, the first to have one free, within `wait_s`; or a
        GatewayError (429 when the wait ran out, 503 when the slots cannot be reached)."""
        until, started_ms = time.monotonic() + wait_s, _ms()
        patient_until = started_ms + ask.patience_ms if ask.patience_ms else 0
        try:
            while True:
                engine = await self.store.take(ask, started_ms + int(wait_s * 1000) + 1000, patient_until)
                if engine:
                    return Slot(self, ask, engine)
                left = until - time.monotonic()
                if left <= 0:
                    await self.store.leave(ask)
                    raise GatewayError(429, "too many image requests are waiting for this model's engines; "
                                            "retry shortly", code="rate_limit_exceeded",
                                       headers={"Retry-After": "2"}, stage="routing")
                freed = self._freed.setdefault(ask.tier_id, asyncio.Event())
                try:
                    await asyncio.wait_for(freed.wait(), min(LOOK_EVERY_S, left))
                except TimeoutError:
                    pass
        except asyncio.CancelledError:
            await asyncio.shield(self._leave_quietly(ask))  # gone while waiting: no trace left
            raise
        except (redis.exceptions.RedisError, OSError):
            raise GatewayError(503, "the gateway cannot reach its shared state; retry shortly",
                               code="service_unavailable", headers={"Retry-After": "2"}, stage="routing") from None

    async def _leave_quietly(self, ask: Ask) -> None:
        try:
            await self.store.leave(ask)
        except (redis.exceptions.RedisError, OSError):
            pass  # its waiting entry ends with its wait; a slot granted meanwhile, with its lease

    async def release(self, ask: Ask, engine: int) -> None:
        try:
            await self.store.release(ask, engine)
        except (redis.exceptions.RedisError, OSError):
            return  # the lease frees it
        freed = self._freed.pop(ask.tier_id, None)
        if freed is not None:
            freed.set()  # this process's waiters look now; the next wait makes a new event


class Slot:
    """A slot held: released once (first token, error, client gone, failover)."""

    def __init__(self, slots: PrefillSlots, ask: Ask, engine: int):
        self.slots, self.ask, self.engine = slots, ask, engine
        self.held = True

    async def release(self) -> None:
        if self.held:
            self.held = False
            await asyncio.shield(self.slots.release(self.ask, self.engine))
