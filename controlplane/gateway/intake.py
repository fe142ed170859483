"""What a key's requests cost the gateway before they are admitted, and the throttle on it.

Reading a body, and opening, decoding and checking its pictures, is work done for a request
that may yet be refused, and a refusal bills nothing. So each request's intake is counted
against its key, a minute at a time: the gateway CPU time it took (GATEWAY_KEY_INTAKE_CPU_S a
minute) and the body bytes it sent (GATEWAY_KEY_INTAKE_MB a minute), each counted a sixth of
a minute at a time against a sixth of its limit, so that no key spends its minute's share in
one burst; and a request refused at intake (never admitted, so never counted by its admission)
as one of its tenant's and its key's requests of the minute. A key past any of them gets a 429
before its next large body is read or its next pictures are opened; a large body declared
in advance is counted before it is read. The counts are shared by every gateway replica (they
live in the ledger's store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from controlplane.gateway import ledger, state
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.ledger import IntakeLimits
from controlplane.gateway.ledger.base import BUDGET_WINDOW_S, intake_retry_after
from controlplane.imaging.budget import MB, DecodeBudget

log = logging.getLogger(__name__)

# Statuses of a request refused at intake that count as one of the minute's requests: what
# the sender got wrong. Not 401 (no key to count), 429 (already throttled) or a 5xx (ours).
_REFUSED = frozenset({400, 403, 404, 405, 413, 422})


@dataclass
class IntakeMeter:
    """One request's intake, as it goes."""

    key: state.KeyInfo
    checked: bool = False
    admitted: bool = False
    cpu_s: float = 0.0  # on the event loop (its body's read); its pictures' are in `budget`
    budget: DecodeBudget | None = None
    body_bytes: int = 0

    @property
    def limits(self) -> IntakeLimits:
        key = self.key
        return IntakeLimits(tenant_requests=key.limits.requests_per_minute if key.limits else None,
                            key_requests=key.key_requests_per_minute,
                            cpu_ms=settings.GATEWAY_KEY_INTAKE_CPU_S * 1000 or None,
                            body_bytes=settings.GATEWAY_KEY_INTAKE_MB * MB or None)

    @contextmanager
    def timed(self) -> Iterator[None]:
        started = time.thread_time()
        try:
            yield
        finally:
            self.cpu_s += time.thread_time() - started

    def cpu_ms(self) -> int:
        return round((self.cpu_s + (self.budget.cpu_spent if self.budget is not None else 0)) * 1000)


async def check(meter: IntakeMeter, *, take_bytes: int = 0) -> None:
    """A 429 when the key has reached a limit of its intake; once per request. Otherwise
    `take_bytes` of body (declared, not yet read) are counted. A store that does not answer
    lets the request through: the throttle is no quota (its admission is)."""
    if meter.checked:
        return
    meter.checked = True
    limits = meter.limits
    if limits.none:
        return
    now = timezone.now()
    try:
        reached = await ledger.intake_over(meter.key.tenant_id, meter.key.key_id, limits, now, take_bytes=take_bytes)
    except Exception as exc:  # noqa: BLE001 - logged; the request goes on unthrottled
        log.warning("could not check the intake of key %s: %s", meter.key.key_id, exc)
        return
    if reached is None:
        return
    retry = str(intake_retry_after(reached, now))
    if reached == "intake_cpu_ms":
        raise GatewayError(429, "this API key's requests have used their share of the gateway's CPU time "
                           f"(reading bodies, decoding images: {settings.GATEWAY_KEY_INTAKE_CPU_S} s a minute, a "
                           f"sixth of it every {BUDGET_WINDOW_S} s); retry after {retry}s",
                           code="rate_limit_exceeded", headers={"Retry-After": retry})
    if reached == "intake_bytes":
        raise GatewayError(429, "this API key's requests have sent their share of request bodies "
                           f"({settings.GATEWAY_KEY_INTAKE_MB:,} MB a minute, a sixth of it every {BUDGET_WINDOW_S} s); "
                           f"retry after {retry}s", code="rate_limit_exceeded", headers={"Retry-After": retry})
    whose = "this API key's" if reached == "key_requests_per_minute" else "your organization's"
    raise GatewayError(429, f"{whose} limit exceeded: {limits.of(reached):,} requests per minute; retry after "
                       f"{retry}s", code="rate_limit_exceeded", headers={"Retry-After": retry})


def refused(meter: IntakeMeter, status: int) -> bool:
    """Whether the request was refused at intake: answered `status` without being admitted."""
    return not meter.admitted and status in _REFUSED


async def charge(meter: IntakeMeter, status: int) -> None:
    """Count what the request's intake cost its key, once it has its answer (`status`)."""
    was_refused = refused(meter, status)
    cpu_ms = meter.cpu_ms()
    limits = meter.limits
    if not (was_refused or cpu_ms or meter.body_bytes) or limits.none:
        return
    try:
        await ledger.intake_charge(meter.key.tenant_id, meter.key.key_id, limits, timezone.now(), cpu_ms=cpu_ms,
                                   body_bytes=meter.body_bytes, refused=was_refused)
    except Exception as exc:  # noqa: BLE001 - a throttle's count, not a bill: logged
        log.warning("could not count the intake of key %s: %s", meter.key.key_id, exc)
