"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from django.http import JsonResponse

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
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def response(self, request_id: str | None = None) -> JsonResponse:
        return error_response(self.status, self.message, code=self.code, param=self.param,
                              headers=self.headers, request_id=request_id)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   headers: dict | None = None, request_id: str | None = None) -> JsonResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    response = JsonResponse(body, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    if request_id:
        response["x-request-id"] = request_id
    return response
