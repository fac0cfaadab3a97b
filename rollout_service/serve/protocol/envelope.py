"""The OpenAI error envelope: the exception every error answer is raised as, and its documented form.

:class:`ServiceError` carries its HTTP status, ``type``, ``param`` and ``code`` and renders itself as
OpenAI's ``{"error": {...}}`` envelope, or in a tagged form that crosses a Serve handle unwrapped;
:func:`bad_request` is the common 400. :class:`ErrorResponse` and :class:`ErrorObject` are the
envelope as the OpenAPI schema documents it. The errors of the other planes become one of these in
:mod:`rollout_service.serve.errors`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ServiceError(Exception):
    """An error with its HTTP status, rendered as the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_result(self) -> dict[str, Any]:
        """Tagged form that crosses a Serve handle without exception wrapping."""
        return {"__error__": self.status, **self.envelope()}

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> "ServiceError":
        e = result["error"]
        return cls(result["__error__"], e["message"], type=e.get("type") or "", param=e.get("param"), code=e.get("code"))


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The envelope every error answer carries (:meth:`ServiceError.envelope`), as the OpenAPI schema
    documents it (OpenAI's error object)."""

    error: ErrorObject


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServiceError:
    return ServiceError(400, message, param=param, code=code)
