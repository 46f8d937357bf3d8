"""The routes the console reads, without a browser: recent and live requests, sessions with a
fork, stats, and the page itself."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.e2e


def test_requests_sessions_fork_and_stats(server: ServerProcess, http: httpx.Client) -> None:
    body = {"model": "smollm2-test", "messages": [{"role": "user", "content": "Hi there."}], "max_tokens": 6}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/v1/chat/completions", json={**body, "n": 99}).status_code == 400
    recent = http.get("/v1/argosy/requests?limit=50").json()["data"]
    statuses = {(e["route"], e["status"]) for e in recent}
    assert ("POST /v1/chat/completions", 200) in statuses and ("POST /v1/chat/completions", 400) in statuses
    assert not any(e["route"].startswith(("GET /v1/argosy/", "GET /health")) for e in recent)
    with http.stream("GET", "/v1/argosy/requests/stream?limit=2") as stream:
        frames = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[6:]))
            if len(frames) == 2:  # the backlog; then a live one, made while following
                http.get("/v1/models")
            if len(frames) == 4:  # its started and finished events
                break
    assert [f["route"] for f in frames[2:]] == ["GET /v1/models"] * 2
    assert [f["kind"] for f in frames[2:]] == ["started", "finished"]

    sessions = http.get("/v1/argosy/sessions?limit=5").json()["data"]
    assert sessions and sessions[0]["metadata"]["kind"] == "chat.completion"
    newest = http.get(f"/v1/argosy/sessions/{sessions[0]['id']}").json()
    messages = [e for e in newest["events"] if e["kind"] == "message"]
    assert messages[0]["role"] == "user" and messages[0]["content"] == "Hi there."
    fork = http.post(f"/v1/argosy/sessions/{newest['id']}/fork", json={"at_event": messages[0]["seq"]}).json()
    assert fork["forked_from"] == {"session_id": newest["id"], "at_event": messages[0]["seq"]}
    assert [e["seq"] for e in http.get(f"/v1/argosy/sessions/{fork['id']}").json()["events"]] == [
        messages[0]["seq"]
    ]
    assert http.post(f"/v1/argosy/sessions/{newest['id']}/fork", json={"at_event": 10_000}).status_code == 400
    assert http.get("/v1/argosy/sessions/nope").status_code == 404

    stats = http.get("/v1/argosy/stats?window=600").json()
    assert stats["requests"] >= 2 and stats["refused"] >= 1 and stats["tokens_per_s"] > 0
    assert stats["ttft_s"]["p50"] > 0 and "smollm2-test" in stats["models"]
    page = http.get("/console")
    assert page.status_code == 200 and "<title>Argosy console</title>" in page.text
