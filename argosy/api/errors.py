"""Errors at the HTTP edge: one table kind -> (HTTP status, type string), one renderer per dialect.

Everything below api/ raises typed errors (argosy/errors.py); this module is the only place
they become HTTP. APIError adds the kinds that only exist at the edge (an unknown route, a
body too large, a model still loading). Request bodies that fail pydantic validation become
an InvalidRequestError whose `param` names the field the way OpenAI does
(`messages[0].role`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pydantic

from argosy.errors import ArgosyError, InvalidRequestError, ModelNotFoundError, OverloadedError

# kind -> (HTTP status, OpenAI error type)
ERROR_TABLE: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unauthorized": (401, "invalid_request_error"),  # OpenAI's own: code invalid_api_key
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "conflict": (409, "invalid_request_error"),  # e.g. the result of an audio job not finished
    "payload_too_large": (413, "invalid_request_error"),
    "rate_limited": (429, "rate_limit_error"),
    "model_loading": (503, "server_error"),
    "overloaded": (503, "server_error"),
    "draining": (503, "server_error"),
    "storage_unavailable": (503, "server_error"),
    "storage_full": (507, "server_error"),
    "model_load_error": (500, "server_error"),
    "internal_error": (500, "server_error"),
}
_FALLBACK = ERROR_TABLE["internal_error"]
_MAX_SHOWN_INPUT_CHARS = 80


class APIError(ArgosyError):
    """An error of a kind only the HTTP edge knows; `headers` go on the response."""

    def __init__(
        self,
        kind: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.kind = kind
        self.headers = headers or {}


def status_of(error: ArgosyError) -> int:
    return ERROR_TABLE.get(error.kind, _FALLBACK)[0]


def headers_of(error: ArgosyError) -> dict[str, str]:
    headers = dict(getattr(error, "headers", {}) or {})
    if isinstance(error, OverloadedError):
        headers.setdefault("retry-after", str(error.retry_after_s))
    return headers


def openai_error_body(error: ArgosyError) -> dict[str, Any]:
    """OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""
    error_type = ERROR_TABLE.get(error.kind, _FALLBACK)[1]
    return {"error": {"message": error.message, "type": error_type, "param": error.param, "code": error.code}}


# kind -> (HTTP status, Anthropic error type). Anthropic answers a busy or still-loading
# server with 529 overloaded_error (its SDK retries it), and has no 503 or 507.
ANTHROPIC_ERROR_TABLE: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "payload_too_large": (413, "request_too_large"),
    "rate_limited": (429, "rate_limit_error"),
    "model_loading": (529, "overloaded_error"),
    "overloaded": (529, "overloaded_error"),
    # a server shutting down is unavailable, not busy: 503 (what load balancers and health
    # checks read; Anthropic's SDK retries any 5xx as it retries 529), typed overloaded_error
    "draining": (503, "overloaded_error"),
    "storage_unavailable": (529, "overloaded_error"),
    "storage_full": (500, "api_error"),
    "model_load_error": (500, "api_error"),
    "internal_error": (500, "api_error"),
}
_ANTHROPIC_FALLBACK = ANTHROPIC_ERROR_TABLE["internal_error"]


def anthropic_status_of(error: ArgosyError) -> int:
    return ANTHROPIC_ERROR_TABLE.get(error.kind, _ANTHROPIC_FALLBACK)[0]


def anthropic_error_body(error: ArgosyError) -> dict[str, Any]:
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}} (no param: the
    message names the field)."""
    error_type = ANTHROPIC_ERROR_TABLE.get(error.kind, _ANTHROPIC_FALLBACK)[1]
    return {"type": "error", "error": {"type": error_type, "message": error.message}}


# kind -> HTTP status on Ollama's routes: its own (400, 404, 413, 429, 500, 503 "server busy").
OLLAMA_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "unauthorized": 401,
    "permission_denied": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "payload_too_large": 413,
    "rate_limited": 429,
    "model_loading": 503,
    "overloaded": 503,
    "draining": 503,
    "storage_unavailable": 503,
    "storage_full": 507,
    "model_load_error": 500,
    "internal_error": 500,
}


def ollama_status_of(error: ArgosyError) -> int:
    return OLLAMA_STATUS.get(error.kind, 500)


def ollama_error_body(error: ArgosyError) -> dict[str, Any]:
    """Ollama's envelope: {"error": "message"}. An unknown model says so in Ollama's words
    (`model "x" not found`), which clients and tools match on."""
    if isinstance(error, ModelNotFoundError):
        served = ", ".join(error.served)
        return {
            "error": f'model "{error.name}" not found (this server serves: {served}; models are configured, not pulled)'
        }
    return {"error": error.message}


def internal_error(exc: BaseException) -> ArgosyError:
    return ArgosyError(f"Internal error: {type(exc).__name__}: {exc}")


# -- pydantic errors -> param ---------------------------------------------------------------


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"; () -> None."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else part
    return param or None


def _shown_input(value: Any) -> str:
    if isinstance(value, dict | list):
        return ""
    shown = json.dumps(value, ensure_ascii=False)
    if len(shown) > _MAX_SHOWN_INPUT_CHARS:
        return ""
    return f" (got {shown})"


def from_validation_error(exc: pydantic.ValidationError) -> InvalidRequestError:
    """The first validation error, as a 400 naming its field."""
    errors = exc.errors(include_url=False)
    if not errors:
        return InvalidRequestError("Invalid request body.")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = str(first.get("ctx", {}).get("error", first["msg"])).rstrip(".")
        return InvalidRequestError(f"We could not parse the JSON body of your request: {detail}.")
    param = param_from_loc(first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ").rstrip(".")
    if first["type"] == "missing":
        text = f"Missing required parameter: '{param}'."
    elif param is None:
        text = f"Invalid request body: {message}."
    else:
        text = f"Invalid '{param}': {message}{_shown_input(first.get('input'))}."
    return InvalidRequestError(text, param=param)
