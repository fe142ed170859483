"""Every request ends in its usage handed over to the ledger: answered, refused, failed or left
by its client. The hand-over runs in a task of its own, which a client leaving cannot
interrupt halfway; `drain` waits for those left when the process stops, once the requests cut
then have handed theirs over (`settle`)."""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async

from controlplane.gateway import ledger
from controlplane.gateway.apps import current_process
from controlplane.gateway.capture import capture_store
from controlplane.gateway.errors import NotAdmitted
from controlplane.metering.records import UsageRecord
from controlplane.redis_clients import until_written

log = logging.getLogger(__name__)
SETTLE_S = 2.0  # at most, for the requests cut when the grace runs out to hand their usage over


def ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def refusal_of(record: UsageRecord) -> UsageRecord:
    """What a request its admission did not admit is recorded as, as any refused before an
    engine worked on it: in the tenant's usage, at no cost (its error marked by the caller)."""
    return UsageRecord(request_id=record.request_id, tenant_id=record.tenant_id, api_key_id=record.api_key_id,
                       tier_id=record.tier_id, stream=record.stream, latency_ms=record.latency_ms,
                       routed_by=record.routed_by, cascade_of=record.cascade_of)


RESTARTING = "the gateway is restarting; retry the request"


def aborted(record: UsageRecord, stage: str, *, left: str, http_status: int = 499) -> None:
    """The request ended before its answer: its client left (`left` says when), or the server
    cut it, its process stopping and the grace over, which it is recorded as instead."""
    if current_process().stopping.cutting:
        record.failed(stage, 503, code="server_restarting", status="aborted", message=RESTARTING)
    else:
        record.failed(stage, http_status, code="client_closed", status="aborted", message=left)


def release_if_admitted(done: asyncio.Future, record: UsageRecord, started: float) -> None:
    """The client left while its request was admitted: recorded at no cost, quota released.
    So too when the admission's reply was lost (its store may have made it all the same):
    the record settles it as it was made, as a 503's would have."""
    if done.cancelled() or (isinstance(done.exception(), NotAdmitted) and done.exception().refused):
        return  # nothing was reserved
    # No engine was sent it: the one chosen beforehand did no work, nothing is billed.
    record.instance_id = None
    aborted(record, "admission", left="the client left while the request was being admitted")
    in_background(hand_over_usage(record, started))


async def drain() -> None:
    """Wait for the work left of answered requests: hand-overs awaiting Redis's reply, and
    what a failed one calls for (each bounded by its store's timeouts). Before the process exits."""
    hand_overs = current_process().hand_overs
    while hand_overs:
        await asyncio.gather(*hand_overs, return_exceptions=True)


async def settle(within_s: float = SETTLE_S) -> None:
    """Wait, `within_s` at most, for requests still being answered. The server cancels those
    left when its grace runs out and goes straight on to stopping; each hands its usage over
    (what `drain` waits for) only once it has run its way out of its cancellation."""
    loop = asyncio.get_running_loop()
    left = [task for task in current_process().answering if task.get_loop() is loop]
    if left:
        await asyncio.wait(left, timeout=within_s)


def answering(coroutine) -> asyncio.Task:
    """The work of answering a request, in a task of its own, known until it ends (`settle`)."""
    task = asyncio.ensure_future(coroutine)
    tasks = current_process().answering
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


def in_background(coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coroutine)
    hand_overs = current_process().hand_overs
    hand_overs.add(task)
    task.add_done_callback(hand_overs.discard)
    return task


async def hand_over_usage(record: UsageRecord, started: float) -> None:
    """Hand the request's usage over. One whose admission ran beside the engine is handed over
    once its admission has its answer (its finish must never reach the ledger before its
    admission does); not admitted, a request its client left is recorded as its refusal."""
    if record.recorded:
        return
    record.recorded = True
    record.latency_ms = ms_since(started)
    # The answer waits until the usage is on its way to Redis (written to its connection: it
    # gets there even if this process dies now), not for Redis's acknowledgement, which the
    # hand-over awaits afterwards, with what a failed one calls for: one round trip fewer on
    # every answer. A hand-over that never writes to Redis (the database's ledger, a Redis that
    # cannot be reached) is waited for to its end. The hand-over runs in a task of its own, which
    # a client leaving (cancelling this one) cannot interrupt halfway.
    written = asyncio.get_running_loop().create_future()
    await until_written(in_background(_hand_over(record, written)), written)


async def _hand_over(record: UsageRecord, written: asyncio.Future | None = None) -> None:
    if record.admission is not None and (failed := await record.admission.failure()) is not None \
            and record.status == "aborted":
        record = failed.recorded_on(refusal_of(record), "admission")
        record.recorded = True
    process = current_process()
    # No tier: refused before its model was known.
    tier = "" if record.tier_id is None else process.tier_names.get(record.tier_id, str(record.tier_id))
    process.counters.count(tier=tier, status=record.status, images=record.image_tokens,
                           disagree=record.image_tokens_disagree)
    if record.checking is not None:
        # Its images sent as they came get their fingerprints once checked (a refused one keeps
        # its empty one: the record is its 400's).
        try:
            checked = await record.checking
        except Exception:  # noqa: BLE001 - the request was answered with what it was
            checked = None
        if checked is not None:
            record.images = [(p.image, tokens, cached) for p, (_, tokens, cached) in
                             zip(checked, record.images, strict=True)]
    try:
        # The usage handed over and the reservation corrected to what was really used, at once.
        await ledger.finish(record, written)
    except Exception:  # never lose the response over metering; the error is logged loudly
        log.exception("could not record usage for %s", record.request_id)
    if record.capture is not None:  # after the hand-over, never in its way
        await sync_to_async(capture_store)(record)
