"""What runs beside the engine's work must pass before its answer is relayed: the checks of
images sent as they came, and the request's admission. One that fails abandons the exchange
and is answered as it would have been had it been awaited first."""

from __future__ import annotations

import asyncio

from controlplane.gateway.admission import Admission
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.http import Response
from controlplane.gateway.prepare import Prepared
from controlplane.gateway.recording import hand_over_usage
from controlplane.gateway.validation import RequestInvalid
from controlplane.metering.records import UsageRecord


async def image_refusal(prepared: Prepared | None) -> GatewayError | None:
    """The 400 of an image sent unchecked that failed its check, once its check is done: what
    a request refused for any other reason is answered with all the same, as it would have been
    had its images been checked before anything else."""
    if prepared is None or prepared.checking is None:
        return None
    try:
        await prepared.images_checked()
    except RequestInvalid as exc:
        return GatewayError(400, str(exc), code=exc.code, param=exc.param)
    return None


async def record_image_refusal(record: UsageRecord, started: float, refusal: GatewayError,
                               request_id: str) -> Response:
    await hand_over_usage(refusal.recorded_on(record, "intake"), started)
    return refusal.response(request_id)


async def answer_once_checks_pass(sending, prepared: Prepared, admission: Admission):
    """The engine's answer to `sending`, once what ran beside the engine's work has passed: the
    checks of images sent as they came, and the request's admission (each takes milliseconds
    at most, where the engine takes tens of them at least). Nothing is answered before. One
    that fails abandons the exchange (the engine drops a request whose connection closes) and
    raises its error as it would have been raised had it been awaited first: an image's 400
    (GatewayError), else the admission's 429 or 503 (NotAdmitted)."""
    checking = prepared.checking
    if checking is not None and not checking.done():  # an image sent as it came, its check running
        answer = asyncio.ensure_future(sending)
        try:
            broken = await image_refusal(prepared)
            failed = await admission.failure()  # awaited either way: nothing is recorded before it
            if broken or failed:
                raise broken or failed
        except BaseException:
            answer.cancel()
            response = await asyncio.gather(answer, return_exceptions=True)
            if response and not isinstance(response[0], BaseException):
                await response[0].aclose()
            raise
        return await answer
    if (broken := await image_refusal(prepared)) is not None:
        sending.close()  # never started
        await admission.failure()  # nothing is recorded before it has its answer
        raise broken
    if admission.answer.done():
        if (failed := await admission.failure()) is not None:
            sending.close()
            raise failed
        return await sending
    try:
        response = await _unless_refused(sending, admission)
    except Exception:
        # The engine failed first (unreachable, or broken): what that means waits for the
        # admission, which a refusal takes precedence over.
        if (failed := await admission.failure()) is not None:
            raise failed from None
        raise
    try:
        failed = await admission.failure()  # the engine's headers came first
    except BaseException:  # the client left, or the engine's watch failed it over, meanwhile
        await response.aclose()
        raise
    if failed is not None:
        await response.aclose()
        raise failed
    return response


async def _unless_refused(sending, admission: Admission):
    """`sending`'s result, or the admission's failure (NotAdmitted) as soon as it has one, the
    exchange abandoned: the admission's answer cancels the wait, rather than the engine's
    answer being waited for in a task of its own (a task a request costs more CPU than the rest
    of this)."""
    task, waiting, refused = asyncio.current_task(), [True], []

    def answered(done: asyncio.Future) -> None:
        # Run soon after the answer, perhaps after the wait ended: then it must not cancel.
        if waiting[0] and not done.cancelled() and done.exception() is not None:
            refused.append(True)
            task.cancel()

    admission.answer.add_done_callback(answered)
    try:
        return await sending
    except asyncio.CancelledError:
        if refused and task.uncancel() == 0:  # only the admission cancelled it, not the client leaving
            raise await admission.failure() from None
        raise
    finally:
        waiting[0] = False
        admission.answer.remove_done_callback(answered)
