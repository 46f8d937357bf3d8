"""The graceful stop through a real `argosy serve` (smollm2): SIGTERM while 8 chat streams run.

Within the grace the streams finish whole, new requests get 503 + Retry-After, /health says
draining, the process exits 0 and every generation is in the session store. With a grace
shorter than the streams, they end with a framed error event (never a silent cut), what they
streamed is still recorded, and the process still exits 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from argosy.sessions.events import Finished, SpanGenerated
from argosy.sessions.sqlite import SqliteSessionStore
from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_STREAMS = 8


@dataclass
class StreamResult:
    request_id: str
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    is_done: bool = False  # ended with data: [DONE]
    error_events: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def stream_chat(base_url: str, request_id: str, max_tokens: int, started: threading.Event) -> StreamResult:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = StreamResult(request_id)
    is_error_next = False
    with (
        httpx.Client(timeout=300) as client,
        client.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                continue
            result.lines.append(line)
            if line == "event: error":
                is_error_next = True
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result.is_done = True
                continue
            payload = json.loads(data)
            if is_error_next:
                result.error_events.append(payload)
                is_error_next = False
                continue
            for choice in payload.get("choices", []):
                result.text += choice["delta"].get("content") or ""
                if choice.get("finish_reason"):
                    result.finish_reasons.append(choice["finish_reason"])
                if result.text:
                    started.set()
            if payload.get("usage"):
                result.completion_tokens = payload["usage"]["completion_tokens"]
    return result


def start_streams(
    server: ServerProcess, max_tokens: int
) -> tuple[concurrent.futures.ThreadPoolExecutor, list[concurrent.futures.Future[StreamResult]]]:
    """NUM_STREAMS chat streams, returned once every one of them is streaming text."""
    pool = concurrent.futures.ThreadPoolExecutor(NUM_STREAMS)
    started = [threading.Event() for _ in range(NUM_STREAMS)]
    futures = [
        pool.submit(stream_chat, server.base_url, f"drain-{i}", max_tokens, started[i])
        for i in range(NUM_STREAMS)
    ]
    deadline = time.monotonic() + 180
    for event, future in zip(started, futures, strict=True):
        while not event.wait(0.2):
            if future.done():
                future.result()  # raises what went wrong
                pytest.fail("a stream ended before it streamed any text")
            assert time.monotonic() < deadline, "the streams did not start"
    return pool, futures


def wait_draining(server: ServerProcess) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        if health.json().get("status") == "draining" or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def stored_generations(data_dir: Path) -> dict[str, tuple[str, int, Finished]]:
    """request_id -> (text, number of token ids, finish) of each chat generation stored."""
    path = data_dir / "sessions.sqlite3"
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT id, metadata FROM sessions WHERE deleted_at IS NULL").fetchall()
    found: dict[str, tuple[str, int, Finished]] = {}
    with SqliteSessionStore(path) as store:
        for session_id, metadata_text in rows:
            metadata = json.loads(metadata_text)
            if metadata.get("kind") != "chat.completion":
                continue
            events = [stored.event for stored in store.read(session_id)]
            spans = [e for e in events if isinstance(e, SpanGenerated)]
            finishes = [e for e in events if isinstance(e, Finished)]
            assert len(finishes) == 1, events
            text = "".join(span.text for span in spans if span.channel == "text")
            found[metadata["request_id"]] = (text, sum(len(s.token_ids) for s in spans), finishes[0])
    return found


def test_sigterm_lets_the_streams_finish_refuses_new_requests_and_exits_0(tmp_path: Path) -> None:
    grace_s = 90.0
    server = ServerProcess(data_dir=tmp_path, extra_flags=["--shutdown-grace", f"{grace_s:g}s"])
    server.start()
    try:
        assert server.process is not None
        pool, futures = start_streams(server, max_tokens=200)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        health = wait_draining(server)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "draining"
        assert health.json()["num_in_flight"] == NUM_STREAMS
        refused = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=10,
        )
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "server_draining"

        results = [future.result(timeout=grace_s) for future in futures]
        pool.shutdown()
        for result in results:
            assert result.error_events == [], result.lines[-3:]
            assert result.finish_reasons == ["length"]
            assert result.completion_tokens == 200
            assert result.is_done and result.lines[-1] == "data: [DONE]"

        returncode = server.process.wait(timeout=grace_s)
        assert returncode == 0, server.log_text()[-3000:]
        assert time.monotonic() - signalled < grace_s
        assert "drained" in server.log_text()

        stored = stored_generations(tmp_path)
        for result in results:
            text, num_token_ids, finish = stored[result.request_id]
            assert finish.reason == "length"
            assert finish.usage["completion_tokens"] == 200
            assert num_token_ids == 200
            assert text == result.text
    finally:
        server.stop()


def test_streams_past_a_short_grace_end_with_a_framed_error_and_the_server_exits_0(tmp_path: Path) -> None:
    server = ServerProcess(data_dir=tmp_path, extra_flags=["--shutdown-grace", "2s"])
    server.start()
    try:
        assert server.process is not None
        pool, futures = start_streams(server, max_tokens=3000)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        results = [future.result(timeout=60) for future in futures]
        pool.shutdown()
        aborted_after = time.monotonic() - signalled
        for result in results:
            assert not result.is_done, result.lines[-3:]  # no [DONE]: the client knows it broke
            assert result.finish_reasons == []
            assert result.lines[-2] == "event: error"
            assert len(result.error_events) == 1
            error = result.error_events[0]["error"]
            assert error["code"] == "server_draining" and error["type"] == "server_error"
            assert "shutting down" in error["message"]
        assert 2.0 <= aborted_after < 10.0

        returncode = server.process.wait(timeout=30)
        assert returncode == 0, server.log_text()[-3000:]
        assert time.monotonic() - signalled < 15.0
        assert f"{NUM_STREAMS} generations aborted" in server.log_text()

        stored = stored_generations(tmp_path)
        for result in results:
            text, num_token_ids, finish = stored[result.request_id]
            assert finish.reason == "error"
            assert 0 < num_token_ids < 3000
            assert text == result.text  # what the client saw is what was recorded
    finally:
        server.stop()
