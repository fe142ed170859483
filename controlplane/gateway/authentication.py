"""Who is asking: the API key of a request, read through the gateway's caches, and what is
refused before a request's body is read (a missing, unknown or unusable key, a body declared
too large, a large body of a key past its intake's limits)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from controlplane.gateway import intake, state
from controlplane.gateway.apps import current_process
from controlplane.gateway.body import LARGE_BODY
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.http import Request
from controlplane.gateway.refusals import KEYLESS
from controlplane.gateway.state import read_or_unavailable


class NotAuthenticated(GatewayError):
    """A 401, and why: `reason` is "missing" (no key sent), "unknown" (no key of ours), or a
    known key's ApiKey.refusal(), that key then being `key`."""

    def __init__(self, status: int, message: str, *, code: str, reason: str, key: state.RefusedKey | None = None):
        super().__init__(status, message, code=code, stage="authentication")
        self.reason, self.key = reason, key


@dataclass(frozen=True)
class Refused:
    """A request refused before its body was read, and the key that sent it when the gateway
    knows it (a usable KeyInfo, or a RefusedKey): its tenant's usage keeps the refusal."""

    error: GatewayError
    key: state.KeyInfo | state.RefusedKey | None


async def authenticate(request: Request) -> state.KeyInfo:
    """The request's usable key; NotAuthenticated, counted by its reason, when it has none."""
    try:
        return await _key_of(request)
    except NotAuthenticated as exc:
        _count(exc.reason)
        raise


def _count(reason: str) -> None:
    """A refusal at authentication counted on /metrics; one with no tenant to record it for,
    in the overview's tally too (refusals.py)."""
    process = current_process()
    process.counters.auth_refused(reason)
    if reason in KEYLESS and process.keyless is not None:
        process.keyless.count(reason)


async def _key_of(request: Request) -> state.KeyInfo:
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise NotAuthenticated(401, "missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", reason="missing")
    if request.key is not None:
        return request.key
    info = await read_or_unavailable("API keys", state.key_info(header[7:].strip()))
    if info is None:
        raise NotAuthenticated(401, "incorrect API key", code="invalid_api_key", reason="unknown")
    if isinstance(info, state.RefusedKey):
        raise _refusal(info)
    return info


def _refusal(key: state.RefusedKey) -> NotAuthenticated:
    """A key of ours that cannot be used: whoever holds its secret is told why (it tells them
    nothing they could not learn from the key's owner, and saves the owner a support call)."""
    if key.reason == "revoked":
        return NotAuthenticated(401, "this API key was revoked", code="invalid_api_key", reason="revoked", key=key)
    if key.reason == "expired":
        return NotAuthenticated(401, "this API key has expired", code="invalid_api_key", reason="expired", key=key)
    return NotAuthenticated(401, "this API key's organization is deactivated", code="invalid_api_key",
                            reason=key.reason, key=key)


async def check_before_body(headers: dict[str, str]) -> Refused | state.KeyInfo:
    """What is checked before the body is read: a missing, unknown or unusable key, a body
    declared past the limit, and a large body of a key past its intake's limits are refused;
    otherwise the caller's key, to read the body for. The key is read first: a refusal of a key
    of ours is its tenant's to see, whatever else is wrong with the request."""
    try:
        key = await authenticate(Request(method="POST", headers=headers, body=b""))
    except NotAuthenticated as exc:
        return Refused(exc, exc.key)
    except GatewayError as exc:  # the keys cannot be read
        return Refused(exc, None)
    declared = headers.get("content-length", "")
    try:
        if declared.isdigit() and int(declared) > settings.GATEWAY_MAX_BODY_BYTES:
            raise GatewayError(413, f"request body exceeds {settings.GATEWAY_MAX_BODY_BYTES} bytes",
                               code="request_too_large")
        if declares_large_body(headers):
            await intake.check(intake.IntakeMeter(key), take_bytes=int(headers["content-length"]))
    except GatewayError as exc:
        return Refused(exc, key)
    return key


def declares_large_body(headers: dict[str, str]) -> bool:
    declared = headers.get("content-length", "")
    return declared.isdigit() and int(declared) >= LARGE_BODY
