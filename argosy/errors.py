"""Typed errors raised anywhere in Argosy and rendered once, at the edge, per dialect.

Each error carries a `kind` (a key of api/errors.py's table: HTTP status and type string),
a human message and, where a client field is at fault, the `param` that names it.
"""

from __future__ import annotations


class ArgosyError(Exception):
    kind: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(ArgosyError):
    """The client asked for something malformed or out of range (HTTP 400)."""

    kind = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context (HTTP 400)."""

    kind = "context_length_exceeded"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFoundError(ArgosyError):
    """Unknown model, response or session (HTTP 404)."""

    kind = "not_found"


class ModelNotFoundError(NotFoundError):
    """A request names a model this server does not serve (HTTP 404): `name` is what it
    named, `served` the ids it could have."""

    def __init__(self, name: str, served: list[str]) -> None:
        super().__init__(
            f"The model '{name}' does not exist; this server serves: {', '.join(served)}.",
            param="model",
            code="model_not_found",
        )
        self.name = name
        self.served = served


class ConflictError(ArgosyError):
    """The thing asked for exists but is not in a state to give it (HTTP 409): an audio job's
    result before the job finished."""

    kind = "conflict"


class OverloadedError(ArgosyError):
    """Admission refused: queue full (HTTP 503 with Retry-After)."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerDrainingError(OverloadedError):
    """The server is shutting down (SIGTERM / SIGINT): a new request is refused (HTTP 503 +
    Retry-After, in every dialect), and a generation still running when the shutdown grace
    ran out is stopped with it (a framed error event when it streams)."""

    kind = "draining"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s)
        self.code = "server_draining"


class StorageError(ArgosyError):
    """The session store cannot be written or read now: a read-only or failing disk, a
    locked database (HTTP 503). Nothing committed before is lost; it serves again once the
    disk does."""

    kind = "storage_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="storage_unavailable")


class StorageFullError(StorageError):
    """The session store's disk is full (HTTP 507 Insufficient Storage)."""

    kind = "storage_full"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "storage_full"


class ModelLoadError(ArgosyError):
    """A model file or folder could not be read or is of an unsupported kind."""

    kind = "model_load_error"


class EngineDeadError(ArgosyError):
    """The engine loop stopped; no request can be served (HTTP 500)."""

    kind = "internal_error"


class ModelUnavailableError(OverloadedError):
    """The model named is not loaded and could not be loaded in time (HTTP 503 + Retry-After)."""

    kind = "model_loading"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s)
        self.code = "model_loading"
