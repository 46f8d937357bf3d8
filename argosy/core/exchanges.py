"""What the console shows when a request is clicked: its request and response, headers and
bodies, kept in memory for the recent requests (ExchangeStore), keys redacted.

The HTTP edge (api/transport.py, RequestEventsMiddleware) captures each side as it passes
(BodyCapture: the first `limit` bytes of a text body, only the size of a binary one — audio,
images, multipart uploads) and files the exchange when the request finishes. The store is
bounded twice: by count (the ring buffer's size) and by bytes (oldest dropped first), so a
long-running server's memory does not grow with its traffic.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

REDACTED = "[redacted]"
# headers that carry a credential (the realtime WebSocket's key rides in its subprotocol)
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "set-cookie",
        "sec-websocket-protocol",
    }
)
# JSON fields that carry one (a body's, at any depth)
SECRET_FIELDS = frozenset({"api_key", "apikey", "password", "secret", "client_secret", "access_token"})
# bodies shown as text; anything else (audio, images, multipart uploads) only by its size
TEXT_TYPES = ("application/json", "text/", "application/x-ndjson", "application/x-www-form-urlencoded")


def redact_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    shown: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        value = REDACTED if name in SECRET_HEADERS else raw_value.decode("latin-1")
        shown[name] = f"{shown[name]}, {value}" if name in shown else value
    return shown


def _redact_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if k.lower() in SECRET_FIELDS else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    return value


class BodyCapture:
    """One side's body as it streams past: its size always, its first `limit` bytes when its
    content type is text."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.content_type = ""
        self._chunks: list[bytes] = []
        self._kept = 0

    def set_type(self, headers: dict[str, str]) -> None:
        self.content_type = headers.get("content-type", "")

    @property
    def is_text(self) -> bool:
        kind = self.content_type.split(";")[0].strip().lower()
        return not kind or kind.startswith(TEXT_TYPES)

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        room = self.limit - self._kept
        if room > 0 and chunk and self.is_text:  # a binary body: its size only
            piece = chunk[:room]
            self._chunks.append(piece)
            self._kept += len(piece)

    def shown(self) -> dict[str, Any]:
        """{"size", "truncated", "body"}: the body as text (JSON pretty-printed with its
        secrets redacted), or None with a note for a binary one."""
        if not self.is_text:
            return {
                "size": self.size,
                "truncated": False,
                "body": None,
                "note": f"{self.content_type} not kept",
            }
        data = b"".join(self._chunks)
        truncated = self.size > len(data)
        text = data.decode("utf-8", errors="replace")
        if not truncated and self.content_type.startswith("application/json") and text:
            # JSON that does not parse is shown as sent: the 400 it got says what was wrong
            with contextlib.suppress(ValueError):
                text = json.dumps(_redact_json(json.loads(text)), indent=2, ensure_ascii=False)
        return {"size": self.size, "truncated": truncated, "body": text}

    @property
    def kept_bytes(self) -> int:
        return self._kept


@dataclass(slots=True)
class Exchange:
    request_id: str
    request_headers: dict[str, str]
    request: BodyCapture
    response_headers: dict[str, str] = field(default_factory=dict)
    response: BodyCapture | None = None

    @property
    def cost(self) -> int:
        return self.request.kept_bytes + (self.response.kept_bytes if self.response else 0) + 1024

    def as_json(self) -> dict[str, Any]:
        response = self.response.shown() if self.response is not None else {"size": 0, "body": None}
        return {
            "request": {"headers": self.request_headers, **self.request.shown()},
            "response": {"headers": self.response_headers, **response},
        }


class ExchangeStore:
    """The last `max_count` exchanges, at most `max_bytes` of bodies in all (oldest first out)."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 32 * 2**20) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Exchange] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, exchange: Exchange) -> None:
        if self.max_count <= 0:
            return
        with self._lock:
            old = self._items.pop(exchange.request_id, None)
            if old is not None:
                self._bytes -= old.cost
            self._items[exchange.request_id] = exchange
            self._bytes += exchange.cost
            while self._items and (len(self._items) > self.max_count or self._bytes > self.max_bytes):
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.cost

    def get(self, request_id: str) -> Exchange | None:
        with self._lock:
            return self._items.get(request_id)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes
