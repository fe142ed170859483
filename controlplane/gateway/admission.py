"""Admission: a request reserved against its tenant's quota and journaled in one step, or
refused with a 429 (a 503 when the quota's store does not answer). Where it is likely to pass,
it runs beside the request's trip to the engine (docs/design/admission-beside.md)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from django.utils import timezone

from controlplane.gateway import ledger, state
from controlplane.gateway.apps import current_process
from controlplane.gateway.errors import GatewayError, NotAdmitted
from controlplane.gateway.ledger import MICROS, SPEND, Ask, Flight, Refused
from controlplane.gateway.prepare import Prepared, TierSpec
from controlplane.gateway.recording import ms_since, release_if_admitted
from controlplane.metering.rating import price_parts
from controlplane.metering.records import UsageRecord
from controlplane.redis_clients import until_written

log = logging.getLogger(__name__)


class OptimisticAdmission:
    """Whether a request's admission may run beside its trip to the engine rather than before it.

    Beside, the engine is sent the request as soon as the script that admits and journals it
    is on its way to Redis (in the kernel's buffer: it gets there even if this process dies
    now, so the request is journaled as it would have been), and the engine's answer is
    relayed only once Redis has admitted it; refused, the exchange is abandoned (the engine
    drops a request whose connection closes) and the client gets the 429 it would have got.
    One round trip to Redis off every request's path. Only where the admission is likely to
    pass, as the engine's work on a request refused is thrown away: not for a tenant whose
    last admission in this process was refused (until one passes again), not while the store
    has not answered this process's last admission (each would wait out its timeout and get a
    503), and not for a large image (the limit on those at once is the one meant to be met,
    their prefill the costliest to throw away, and one waiting for its turn has no engine
    yet). A burst beyond a limit still reaches the engine up to the first refusal, each
    abandoned within a round trip to Redis. The database's ledger answers once its
    transaction commits: its admissions are awaited.

    One window is left: a request whose admission does not journal it at its first script (the
    period's counters to start, or Redis lost its scripts: a second script follows, tens of
    milliseconds later at most) is with the engine meanwhile, and were the gateway to die
    then, the engine's work on it would be billed to nobody (its client got nothing)."""

    def __init__(self):
        self.refused: set[int] = set()  # tenants
        self.store_silent = False

    def likely(self, tenant_id: int) -> bool:
        return not self.store_silent and tenant_id not in self.refused

    def answered(self, tenant_id: int, *, admitted: bool) -> None:
        self.store_silent = False
        if admitted:
            self.refused.discard(tenant_id)
        else:
            self.refused.add(tenant_id)

    def unanswered(self) -> None:
        self.store_silent = True




@dataclass(frozen=True)
class Admission:
    """A request's admission: answered before the request was forwarded, or running beside its
    trip to the engine (see OptimisticAdmission)."""

    record: UsageRecord
    answer: asyncio.Future  # the request's Flight once admitted; a NotAdmitted if not

    async def flight(self) -> Flight:
        """The request's flight once admitted (NotAdmitted if not). A caller giving up does
        not stop the admission."""
        return await asyncio.shield(self.answer)

    async def failure(self) -> NotAdmitted | None:
        """Once answered: why it was not admitted, or None."""
        try:
            await asyncio.shield(self.answer)
        except NotAdmitted as failed:
            return failed
        return None


def worst_cost(image_tokens: list[int], text_tokens: int, max_tokens: int, tier: TierSpec, currency: str) -> dict:
    """The most a request can cost, its output at max_tokens and no image cached, in micro-units
    of the budgets' `currency`, and the rates that price what it used when it ends; a tier
    priced in another currency costs the budgets nothing."""
    if tier.rates is None or tier.currency != currency:
        return {}
    total = price_parts(images=[(tokens, 0) for tokens in image_tokens], unlined=(0, 0), text_tokens=text_tokens,
                        output_tokens=max_tokens, rates=tier.rates).total
    return {"cost": int(total * MICROS), "rates": tier.rates}


def worst_ask(key: state.KeyInfo, tier: TierSpec, image_tokens: list[int], text_tokens: int,
              max_tokens: int) -> Ask | None:
    """What a request reserves against its key's limits (None: it has none)."""
    if key.limits is None:
        return None
    return Ask(image_tokens=sum(image_tokens), total_tokens=text_tokens + sum(image_tokens) + max_tokens,
               large=sum(image_tokens) > tier.large_image_threshold, key_id=key.key_id,
               **worst_cost(image_tokens, text_tokens, max_tokens, tier, key.limits.currency))


async def admit(request_id: str, key: state.KeyInfo, tier: TierSpec, prepared: Prepared,
                 started: float, *, engine=None, also: Ask | None = None, marks=None) -> Admission:
    """Reserve the request against the tenant's quota and journal it, in one step; or refuse
    it with a 429. `also`: room held beside it until it settles (a cascade's second attempt's
    worst case); `marks`: what its record says of how it was routed. With its engine chosen and its admission likely to pass, the admission runs
    beside the request's trip to that engine (see OptimisticAdmission): returned once it is on its way to
    the ledger's store, answered while the engine works."""
    record = UsageRecord(
        request_id=request_id, tenant_id=key.tenant_id, api_key_id=key.key_id, tier_id=tier.id,
        stream=bool(prepared.body.get("stream")), images=[(p.image, p.tokens, 0) for p in prepared.images],
        image_tokens=prepared.image_tokens, text_tokens=prepared.text_tokens,
        counted_prompt_tokens=prepared.text_tokens + prepared.image_tokens, prompt_estimated=prepared.estimated,
        prepare_ms=ms_since(started),  # the images are ready (and moderated) when admission starts
        instance_id=engine.id if engine is not None else None,
        checking=prepared.checking,
    )
    if marks is not None:
        marks.mark(record)
    ask = worst_ask(key, tier, [p.tokens for p in prepared.images], prepared.text_tokens, prepared.body["max_tokens"])
    if ask is not None and also is not None:
        ask = ask.plus(also)
    key_counted_at = None
    if key.key_requests_per_minute is not None:
        key_counted_at = timezone.now()
        try:
            counted = await ledger.key_rate(key.key_id, key.key_requests_per_minute, key_counted_at)
        except Exception:
            log.exception("could not check the rate of key %s for %s", key.key_id, request_id)
            raise quota_unavailable() from None
        if not counted:
            retry = 60 - timezone.now().second
            raise GatewayError(429, f"this API key's limit exceeded: {key.key_requests_per_minute:,} requests "
                               f"per minute; retry after {retry}s", code="rate_limit_exceeded",
                               headers={"Retry-After": str(retry)})
    written = asyncio.get_running_loop().create_future() \
        if engine is not None and not (ask is not None and ask.large) and current_process().optimistic.likely(key.tenant_id) else None
    answer = asyncio.ensure_future(admission_answer(record, key, ask, key_counted_at, written))
    answer.add_done_callback(lambda done: done.cancelled() or done.exception())  # whoever looks, or none
    try:
        if written is not None:
            await until_written(answer, written)
        else:
            await asyncio.shield(answer)
    except asyncio.CancelledError:
        # A request admitted just as the client leaves must still be released.
        answer.add_done_callback(lambda done: release_if_admitted(done, record, started))
        raise
    if answer.done():
        answer.result()  # its refusal, before anything is sent
        return Admission(record, answer)
    record.admission = Admission(record, answer)
    return record.admission


async def admission_answer(record: UsageRecord, key: state.KeyInfo, ask: Ask | None, key_counted_at,
                     written: asyncio.Future | None) -> Flight:
    try:
        flight = await ledger.admit(record, key.limits, ask, written)
    except Refused as refused:
        current_process().optimistic.answered(key.tenant_id, admitted=False)
        if key_counted_at is not None:
            await ledger.key_rate_return(key.key_id, key_counted_at)
        code = "rate_limit_exceeded" if refused.limit in ("requests_per_minute", "concurrent_large_images") \
            else "budget_exceeded" if refused.limit in SPEND else "insufficient_quota"
        raise NotAdmitted(429, str(refused), code=code, headers={"Retry-After": str(refused.retry_after)}) from None
    except Exception:
        # The quota cannot be checked (its store does not answer): nothing is answered unchecked.
        current_process().optimistic.unanswered()
        log.exception("could not admit %s against its quota", record.request_id)
        raise quota_unavailable() from None
    if flight.answered:
        current_process().optimistic.answered(key.tenant_id, admitted=True)
    else:  # a request without a quota goes on without its journal: not an answer
        current_process().optimistic.unanswered()
    return flight


def quota_unavailable() -> NotAdmitted:
    return NotAdmitted(503, "the quota service is unavailable; retry shortly", code="quota_unavailable",
                        headers={"Retry-After": "5"})
