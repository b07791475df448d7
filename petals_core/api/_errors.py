"""Errors of the OpenAI-compatible endpoint, in OpenAI's shape and with its status codes."""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError"]


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    ``type`` follows OpenAI's: ``invalid_request_error`` (400, 404, 413), ``rate_limit_error``
    (429), ``server_error`` (500, 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def bad_request(cls, message: str, *, param: str | None = None) -> ApiError:
        return cls(400, message, param=param, code="invalid_value" if param else None)


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
