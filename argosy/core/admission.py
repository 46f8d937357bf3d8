"""Admission (SPEC §6): a bounded queue of generations waiting to start, and each request's QoS.

A generation is *waiting* from the moment the core admits it until its first engine output
(its prompt is prefilled and a token sampled) or until it ends, whichever comes first. At
most `max_waiting` generations wait at once; one more is refused with OverloadedError (503 +
Retry-After) before anything reaches the engine, so a burst never piles up unboundedly. One
HTTP request is one generation whatever its `n` or number of prompts: the bound is on
clients kept waiting, not on engine sequences.

The QoS class comes from the body's `priority` field or the `x-argosy-qos` header (the field
wins when both are given); `interactive` when neither is. Anything else is a 400 naming
where it came from.
"""

from __future__ import annotations

import threading
from typing import Any

from argosy.config import QOS_CLASSES
from argosy.errors import InvalidRequestError, OverloadedError

QOS_HEADER = "x-argosy-qos"
DEFAULT_QOS = "interactive"


class AdmissionQueue:
    """Counts generations waiting to start; `admit()` refuses one past the bound."""

    def __init__(self, max_waiting: int, retry_after_s: int = 1) -> None:
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self._num_waiting = 0
        self._lock = threading.Lock()  # tickets may be released by the garbage collector

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def admit(self) -> Ticket:
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                raise OverloadedError(
                    f"The server is overloaded: {self._num_waiting} requests are already waiting to "
                    f"start (limit {self.max_waiting}). Retry after {self.retry_after_s} s.",
                    retry_after_s=self.retry_after_s,
                )
            self._num_waiting += 1
        return Ticket(self)

    def _leave(self) -> None:
        with self._lock:
            self._num_waiting -= 1


class Ticket:
    """One admitted generation's place in the queue; it leaves once, on `started()` or
    `release()`, whichever comes first (both are idempotent)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: AdmissionQueue) -> None:
        self._queue: AdmissionQueue | None = queue

    @property
    def is_waiting(self) -> bool:
        return self._queue is not None

    def started(self) -> None:
        self.release()

    def release(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            queue._leave()

    def __del__(self) -> None:  # a stream built but never run must not hold its place
        self.release()


def request_qos(field_value: Any, header_value: str | None) -> str:
    """The QoS class of a request: its `priority` field, else the x-argosy-qos header."""
    if field_value is not None:
        return _checked(field_value, "priority", "The 'priority' field")
    if header_value is not None:
        return _checked(header_value.strip(), None, f"The {QOS_HEADER} header")
    return DEFAULT_QOS


def _checked(value: Any, param: str | None, where: str) -> str:
    if isinstance(value, str) and value in QOS_CLASSES:
        return value
    shown = repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
    raise InvalidRequestError(
        f"{where} must be one of {', '.join(QOS_CLASSES)}; got {shown}.", param=param or QOS_HEADER
    )
