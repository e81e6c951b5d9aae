"""The server's errors, answered as OpenAI's API answers them (`{"error": {"message", "type", "param",
"code"}}`): every refusal is an `APIError` with its status and the parameter at fault."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..errors import RagKVCacheError


class APIError(RagKVCacheError):
    """An error answered as OpenAI's API answers it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(RagKVCacheError):
    """The client disconnected before its answer was complete."""


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request body, as an OpenAI-style 400."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif first.get("type") == "missing":
        message = f"missing required field {param!r}"
    else:
        message = f"{param + ': ' if param else ''}{first['msg']}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, message + more, param=param, code="invalid_request")
