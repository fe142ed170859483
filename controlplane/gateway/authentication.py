"""Who is asking: the API key of a request, read through the gateway's caches, and what is
refused before a request's body is read (a body declared too large, a missing or unknown key,
a large body of a key past its intake's limits)."""

from __future__ import annotations

from django.conf import settings

from controlplane.gateway import intake, state
from controlplane.gateway.body import LARGE_BODY
from controlplane.gateway.errors import GatewayError, error_response
from controlplane.gateway.http import Request, Response
from controlplane.gateway.state import read_or_unavailable


async def authenticate(request: Request) -> state.KeyInfo:
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer ") or not header[7:].strip():
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    if request.key is not None:
        return request.key
    info = await read_or_unavailable("API keys", state.key_info(header[7:].strip()))
    if info is None:
        raise GatewayError(401, "incorrect, expired or revoked API key", code="invalid_api_key")
    return info


async def check_before_body(headers: dict[str, str]) -> Response | state.KeyInfo:
    """What is checked before the body is read: a body declared past the limit, a missing or
    unknown key, and a large body of a key past its intake's limits are refused (the response);
    otherwise the caller's key, to read the body for."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.GATEWAY_MAX_BODY_BYTES:
        return error_response(413, f"request body exceeds {settings.GATEWAY_MAX_BODY_BYTES} bytes",
                              code="request_too_large")
    try:
        key = await authenticate(Request(method="POST", headers=headers, body=b""))
        if declares_large_body(headers):
            await intake.check(intake.IntakeMeter(key), take_bytes=int(headers["content-length"]))
    except GatewayError as exc:
        return exc.response()
    return key


def declares_large_body(headers: dict[str, str]) -> bool:
    declared = headers.get("content-length", "")
    return declared.isdigit() and int(declared) >= LARGE_BODY
