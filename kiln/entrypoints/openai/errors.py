"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server knows about is an `APIError` with its HTTP status; handlers raise
it and one exception handler renders it. A request that fails never touches the engine
(or was aborted there), so the next request is served normally.
"""
from __future__ import annotations

import re
from typing import Any, Collection

from pydantic import ValidationError
from starlette.responses import JSONResponse

# Union members that pydantic appends to an error location: not field names.
_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|dict|list|none)$")
# SamplingParams' errors start with the field ("max_tokens=-1 must ...", "stop contains
# ...", "logit_bias[...]"): that field is the parameter at fault.
_FIELD_PREFIX = re.compile(r"^(\w+)[=\[ ]")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem of a body that failed to parse, as a 400 naming the field."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['msg']}")
    parts = [str(p) for p in err["loc"] if isinstance(p, int) or not _UNION_TAG.search(p)]
    param = ".".join(parts) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"unknown parameter '{param}': kiln does not implement it", param)
    if err["type"] == "model_type" and not parts:
        return bad_request("the request body must be a JSON object")
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    return bad_request(f"{param}: {err['msg']} (got {_short(err.get('input'))}){more}", param)


def from_value_error(exc: ValueError, fields: Collection[str],
                     rename: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine: the message already names the field
    and the fix. A message that starts with one of `fields` blames that parameter;
    `rename` maps kiln's field name back to the request's."""
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    param = match.group(1) if match and match.group(1) in fields else None
    if param is not None and rename:
        param = rename.get(param, param)
    return bad_request(message, param)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
