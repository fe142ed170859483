"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from controlplane.gateway.http import Response, json_response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None, stage: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.stage = stage  # where it failed (metering.records.STAGES), when the raiser knows better

    def recorded_on(self, record, stage: str):
        """`record` marked as failed with this error, at its own stage or else `stage`."""
        return record.failed(self.stage or stage, self.status, code=self.code or "", message=self.message,
                             param=self.param or "")

    def response(self, request_id: str | None = None) -> Response:
        return error_response(self.status, self.message, code=self.code, param=self.param,
                              headers=self.headers, request_id=request_id)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   headers: dict | None = None, request_id: str | None = None) -> Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    headers = dict(headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    return json_response(body, status=status, headers=headers)


class NotAdmitted(GatewayError):
    """A request's admission failed: its tenant's quota refused it (429), or the quota's store
    did not answer (503; it may have made the reservation all the same, which the request's
    record then settles as it was made)."""

    @property
    def refused(self) -> bool:
        return self.status == 429
