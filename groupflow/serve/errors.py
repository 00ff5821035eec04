"""OpenAI-shaped errors: ``ApiError``, a request's 4xx or 5xx, and its JSON body.

Design decision: every error a client sees is OpenAI's JSON (``{"error": {"message", "type",
"param", "code"}}``) — a 4xx with the offending field in ``param`` (and first in the message, as
the validation errors say it), a 404/405, an engine's 500 alike. The endpoints raise ``ApiError``
where they find a problem; the HTTP layer (``app``) and the streams (``answers``) only render it.
An unexpected failure becomes that request's 500, logged without a traceback (``server_error``).
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

log = logging.getLogger("groupflow")

__all__ = ["ApiError", "error_response", "server_error"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        if param and not message.startswith(param):
            message = f"{param}: {message}"  # the field first, as the validation errors say it
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.kind)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def server_error(exc: Exception) -> ApiError:
    """An unexpected failure (the engine's) as this request's 500, logged without a traceback
    (``--log-level DEBUG`` shows it)."""
    if isinstance(exc, ApiError):
        return exc
    log.warning("a request failed: %s: %s", type(exc).__name__, exc)
    log.debug("the failure's traceback", exc_info=exc)
    return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", None, "server_error")
