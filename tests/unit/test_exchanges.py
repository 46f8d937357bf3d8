"""The console's request detail (argosy/core/exchanges.py) and its charts' history
(argosy/core/stats.py): what is kept of a body, what is redacted, how the memory is bounded,
and the sampler's keeping."""

from __future__ import annotations

import asyncio
import json

from argosy.core.exchanges import REDACTED, BodyCapture, Exchange, ExchangeStore, redact_headers
from argosy.core.stats import StatsHistory, percentile


def test_headers_that_carry_a_key_are_redacted() -> None:
    shown = redact_headers(
        [
            (b"Authorization", b"Bearer sk-1"),
            (b"x-api-key", b"sk-2"),
            (b"sec-websocket-protocol", b"realtime, openai-insecure-api-key.sk-3"),
            (b"content-type", b"application/json"),
            (b"accept", b"a"),
            (b"accept", b"b"),
        ]
    )
    assert shown == {
        "authorization": REDACTED,
        "x-api-key": REDACTED,
        "sec-websocket-protocol": REDACTED,
        "content-type": "application/json",
        "accept": "a, b",
    }


def test_a_json_body_is_pretty_printed_with_its_secrets_redacted() -> None:
    capture = BodyCapture(limit=1000)
    capture.set_type({"content-type": "application/json"})
    body = {"model": "m", "api_key": "sk-x", "tools": [{"auth": {"Password": "p", "user": "u"}}]}
    raw = json.dumps(body).encode()
    capture.add(raw[:10])
    capture.add(raw[10:])
    shown = capture.shown()
    assert shown["size"] == len(raw) and not shown["truncated"]
    assert json.loads(shown["body"]) == {
        "model": "m",
        "api_key": REDACTED,
        "tools": [{"auth": {"Password": REDACTED, "user": "u"}}],
    }


def test_a_long_body_keeps_its_first_bytes_and_says_so() -> None:
    capture = BodyCapture(limit=8)
    capture.set_type({"content-type": "text/event-stream"})
    for chunk in (b"data: 1\n\n", b"data: 2\n\n", b""):
        capture.add(chunk)
    assert capture.shown() == {"size": 18, "truncated": True, "body": "data: 1\n"}
    assert capture.kept_bytes == 8


def test_a_binary_body_is_only_measured() -> None:
    capture = BodyCapture(limit=1000)
    capture.set_type({"content-type": "audio/wav"})
    capture.add(b"RIFF" + bytes(100))
    assert capture.shown() == {"size": 104, "truncated": False, "body": None, "note": "audio/wav not kept"}
    assert capture.kept_bytes == 0
    untyped = BodyCapture(limit=1000)  # a GET without a body: no content type, shown as text
    assert untyped.shown() == {"size": 0, "truncated": False, "body": ""}


def exchange(request_id: str, size: int) -> Exchange:
    capture = BodyCapture(limit=size)
    capture.add(b"x" * size)
    return Exchange(request_id, {}, capture)


def test_the_store_is_bounded_by_count_and_by_bytes_oldest_out() -> None:
    store = ExchangeStore(max_count=3, max_bytes=10**9)
    for index in range(5):
        store.put(exchange(f"r{index}", 10))
    assert len(store) == 3 and store.get("r1") is None and store.get("r4") is not None
    by_bytes = ExchangeStore(max_count=100, max_bytes=3 * (4000 + 1024))
    for index in range(5):
        by_bytes.put(exchange(f"r{index}", 4000))
    assert [by_bytes.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert by_bytes.bytes == 3 * (4000 + 1024)
    by_bytes.put(exchange("r4", 10))  # the same id again (a client's x-request-id): replaced
    assert len(by_bytes) == 3 and by_bytes.bytes == 2 * (4000 + 1024) + 10 + 1024
    assert ExchangeStore(max_count=0).get("r") is None


def test_percentiles() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0


def test_the_history_samples_on_its_own_and_keeps_its_hour() -> None:
    taken: list[float] = []

    def take(window: float) -> dict[str, float]:
        taken.append(window)
        return {"time": float(len(taken))}

    history = StatsHistory(take, interval_s=0.01, window_s=60.0, keep_s=0.05)
    assert history.points.maxlen == 5

    async def run() -> None:
        await history.start()
        while len(taken) < 8:
            await asyncio.sleep(0.01)
        await history.stop()

    asyncio.run(run())
    count = len(taken)
    assert set(taken) == {60.0} and len(history.points) == 5
    assert [p["time"] for p in history.since(count - 2.0)] == [count - 1.0, float(count)]
    assert len(history.since(None)) == 5
