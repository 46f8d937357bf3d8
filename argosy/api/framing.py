"""Stream framing, once for every dialect: server-sent events (OpenAI, Anthropic) and NDJSON
(Ollama).

A stream is `data: {json}\\n\\n` frames, then `data: [DONE]\\n\\n` when it ended normally. A
failure after the first byte went out cannot change the status any more: it becomes one
framed `event: error\\ndata: {"error": {...}}\\n\\n`, and no `[DONE]` follows it, so a client
never mistakes a broken stream for a finished one.

While a stream has nothing to send for a while (a long prefill, a queue), its chunks may hold
a None: framed as the SSE comment `: keep-alive` (KEEPALIVE_FRAME), so a proxy with an idle
timeout keeps the connection; clients skip comments (`keepalive_events` makes the Nones from
a CoreStream, every `--sse-keepalive-s` seconds without output).

What a stream could not honour but only learned once under way (its headers are gone: a
request timeout, say) is named in an SSE comment just before `[DONE]`:
`: x-argosy-degraded: request_timeout` (clients skip comments; people and proxies read them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from argosy.api.errors import internal_error
from argosy.chat.events import Event
from argosy.core.stream import CoreStream
from argosy.errors import ArgosyError

log = logging.getLogger("argosy.api")

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"


def _json(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def data_frame(payload: Any) -> bytes:
    return b"data: " + _json(payload) + b"\n\n"


def error_frame(payload: Any) -> bytes:
    return b"event: error\ndata: " + _json(payload) + b"\n\n"


def event_frame(kind: str, payload: Any) -> bytes:
    return f"event: {kind}\ndata: ".encode() + _json(payload) + b"\n\n"


def degraded_comment(fields: list[str]) -> bytes:
    return b": x-argosy-degraded: " + ", ".join(fields).encode("utf-8") + b"\n\n"


def keepalive_events(stream: CoreStream, every_s: float) -> AsyncGenerator[Event | None, None]:
    """`stream`'s events, with a None whenever none came for `every_s` seconds (0: never),
    the stream's own heartbeat (as Anthropic's `ping`). Close it (contextlib.aclosing) before
    the stream ends, so its wait ends before the engine requests are aborted."""
    if every_s > 0:
        return stream.with_heartbeats(every_s)
    return cast(AsyncGenerator[Event | None, None], aiter(stream))


async def sse_frames(
    chunks: AsyncIterator[dict[str, Any] | None],
    render_error: Callable[[ArgosyError], dict[str, Any]],
    degraded: list[str] | None = None,
    *,
    event_key: str | None = None,
    done: bool = True,
) -> AsyncIterator[bytes]:
    """Frame each chunk; end with [DONE] (unless `done` is False), or with one error frame if
    `chunks` raised. `event_key`: name each frame's event by that field of its payload
    (`event: response.created`), as the Responses and Anthropic streams do. A None chunk is a
    keep-alive comment. `degraded` is read at the end (the stream fills it as it goes)."""
    try:
        async for chunk in chunks:
            if chunk is None:
                yield KEEPALIVE_FRAME
                continue
            yield event_frame(chunk[event_key], chunk) if event_key is not None else data_frame(chunk)
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
    if done:
        yield DONE_FRAME


async def ndjson_lines(
    chunks: AsyncIterator[dict[str, Any]],
    render_error: Callable[[ArgosyError], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """One JSON object per line (Ollama's streams); a failure under way is one last line
    with the dialect's error object."""
    try:
        async for chunk in chunks:
            yield _json(chunk) + b"\n"
    except ArgosyError as exc:
        yield _json(render_error(exc)) + b"\n"
    except Exception as exc:
        log.exception("stream failed")
        yield _json(render_error(internal_error(exc))) + b"\n"
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


class SSEResponse(StreamingResponse):
    """A StreamingResponse for text/event-stream (or `media_type`) that always closes its
    iterator.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here runs the dialect's and the core's cleanup (which
    aborts the engine requests) at once.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(
            content,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
            media_type=media_type or self.media_type,
        )
        self._frames = content
        self.closers: list[Callable[[], None]] = []  # run after the frames closed, whatever happened

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._frames.aclose()  # type: ignore[attr-defined]
            for close in self.closers:
                close()


class NDJSONResponse(SSEResponse):
    media_type = "application/x-ndjson"
