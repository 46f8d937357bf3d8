"""SSE framing: data frames, [DONE] only after a normal end, a framed error and nothing after it;
heartbeats between items that are slow to come."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from argosy.api.errors import openai_error_body
from argosy.api.framing import DONE_FRAME, data_frame, error_frame, sse_frames
from argosy.errors import ArgosyError, InvalidRequestError


def run_frames(chunks: AsyncIterator[dict[str, Any]]) -> list[bytes]:
    async def drain() -> list[bytes]:
        return [frame async for frame in sse_frames(chunks, openai_error_body)]

    return asyncio.run(drain())


def test_data_frame_is_one_line_of_json() -> None:
    frame = data_frame({"a": "x\ny", "b": "é"})
    assert frame == 'data: {"a":"x\\ny","b":"é"}\n\n'.encode()
    assert frame.count(b"\n") == 2


def test_error_frame_names_the_event() -> None:
    frame = error_frame({"error": {"message": "m"}})
    assert frame == b'event: error\ndata: {"error":{"message":"m"}}\n\n'


def test_a_normal_stream_ends_with_done() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"n": 1}
        yield {"n": 2}

    frames = run_frames(chunks())
    assert frames == [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', DONE_FRAME]
    assert DONE_FRAME == b"data: [DONE]\n\n"


def test_a_failure_mid_stream_is_a_framed_error_and_no_done() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"n": 1}
        raise InvalidRequestError("the template refused", "messages")

    frames = run_frames(chunks())
    assert frames[0] == b'data: {"n":1}\n\n'
    assert len(frames) == 2
    assert frames[1].startswith(b"event: error\ndata: ")
    payload = json.loads(frames[1].split(b"data: ", 1)[1])
    assert payload == {
        "error": {
            "message": "the template refused",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
    }
    assert DONE_FRAME not in frames


def test_an_unexpected_exception_is_a_server_error_frame() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        raise RuntimeError("kaput")
        yield {}  # pragma: no cover - makes this an async generator

    frames = run_frames(chunks())
    assert len(frames) == 1
    payload = json.loads(frames[0].split(b"data: ", 1)[1])
    assert payload["error"]["type"] == "server_error"
    assert "kaput" in payload["error"]["message"]


def test_closing_the_frames_closes_the_chunks() -> None:
    closed: list[bool] = []

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        try:
            for n in range(100):
                yield {"n": n}
        finally:
            closed.append(True)

    async def read_two() -> None:
        frames = sse_frames(chunks(), openai_error_body)
        await frames.__anext__()
        await frames.__anext__()
        await frames.aclose()  # type: ignore[attr-defined]

    asyncio.run(read_two())
    assert closed == [True]


def test_argosy_error_subclasses_keep_their_kind() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        raise ArgosyError("engine gone")
        yield {}  # pragma: no cover

    payload = json.loads(run_frames(chunks())[0].split(b"data: ", 1)[1])
    assert payload["error"]["type"] == "server_error"
    assert payload["error"]["message"] == "engine gone"
