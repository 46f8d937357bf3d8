"""Server-sent events framing, once for every SSE dialect.

A stream is `data: {json}\\n\\n` frames, then `data: [DONE]\\n\\n` when it ended normally. A
failure after the first byte went out cannot change the status any more: it becomes one
framed `event: error\\ndata: {"error": {...}}\\n\\n`, and no `[DONE]` follows it, so a client
never mistakes a broken stream for a finished one.

What a stream could not honour but only learned once under way (its headers are gone: a
request timeout, say) is named in an SSE comment just before `[DONE]`:
`: x-argosy-degraded: request_timeout` (clients skip comments; people and proxies read them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from argosy.api.errors import internal_error
from argosy.errors import ArgosyError

log = logging.getLogger("argosy.api")

DONE_FRAME = b"data: [DONE]\n\n"


def _json(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def data_frame(payload: Any) -> bytes:
    return b"data: " + _json(payload) + b"\n\n"


def error_frame(payload: Any) -> bytes:
    return b"event: error\ndata: " + _json(payload) + b"\n\n"


def degraded_comment(fields: list[str]) -> bytes:
    return b": x-argosy-degraded: " + ", ".join(fields).encode("utf-8") + b"\n\n"


async def sse_frames(
    chunks: AsyncIterator[dict[str, Any]],
    render_error: Callable[[ArgosyError], dict[str, Any]],
    degraded: list[str] | None = None,
) -> AsyncIterator[bytes]:
    """Frame each chunk; end with [DONE], or with one error frame if `chunks` raised.
    `degraded` is read at the end (the stream fills it as it goes)."""
    try:
        async for chunk in chunks:
            yield data_frame(chunk)
    except ArgosyError as exc:
        yield error_frame(render_error(exc))
        return
    except Exception as exc:
        log.exception("stream failed")
        yield error_frame(render_error(internal_error(exc)))
        return
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    if degraded:
        yield degraded_comment(degraded)
    yield DONE_FRAME


class SSEResponse(StreamingResponse):
    """A StreamingResponse for text/event-stream that always closes its iterator.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here runs the dialect's and the core's cleanup (which
    aborts the engine requests) at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(
            content,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
        )
        self._frames = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._frames.aclose()  # type: ignore[attr-defined]
