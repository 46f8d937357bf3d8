"""Request events' sinks: the JSON-lines file (rotated) and the in-memory ring; a failing
observer never fails the request; the dialect a path belongs to."""

from __future__ import annotations

import json
from pathlib import Path

from argosy.core.events import EventBus, JsonlSink, RequestEvent, RequestRecord, RingBuffer, dialect_of


def finished(index: int) -> RequestEvent:
    record = RequestRecord(request_id=f"req-{index}", method="POST", path="/v1/chat/completions", status=200)
    record.refused("rate_limited", "x" * 1000)
    return record.event("finished")


def test_jsonl_sink_rotates_and_keeps_three_old_files(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=2000, backups=3)
    for index in range(40):
        sink(finished(index))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"]
    newest = [json.loads(line) for line in path.read_text().splitlines()]
    assert newest[-1]["request_id"] == "req-39" and all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    assert len(newest[-1]["error"]) == 500  # an error message is capped
    assert "client" not in newest[-1]  # unknown fields are left out, not null


def test_ring_buffer_keeps_the_last_finished_requests() -> None:
    ring = RingBuffer(size=3)
    bus = EventBus([ring])
    for index in range(5):
        record = RequestRecord(request_id=f"req-{index}", method="GET", path="/health")
        bus.emit(record.event("started"))
        bus.emit(record.event("finished"))
    assert [e.request_id for e in ring.recent()] == ["req-2", "req-3", "req-4"]
    assert [e.request_id for e in ring.recent(1)] == ["req-4"]


def test_a_failing_observer_is_logged_and_the_others_still_hear() -> None:
    heard: list[RequestEvent] = []

    def broken(event: RequestEvent) -> None:
        raise RuntimeError("observer bug")

    EventBus([broken, heard.append]).emit(finished(1))
    assert len(heard) == 1


def test_dialects() -> None:
    assert dialect_of("/api/chat") == "ollama"
    assert dialect_of("/v1/messages/count_tokens") == "anthropic"
    assert dialect_of("/v1/chat/completions") == "openai"
    assert dialect_of("/tokenize") == "openai"
    assert dialect_of("/v1/argosy/engine") == dialect_of("/health") == dialect_of("/metrics") == "argosy"
