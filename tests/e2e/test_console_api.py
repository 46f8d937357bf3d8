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
    assert http.get("/v1/argosy/stats?window=0").status_code == 400
    page = http.get("/console")
    assert page.status_code == 200 and "<title>Argosy console</title>" in page.text


def test_a_listed_request_shows_its_headers_and_bodies_keys_redacted(
    server: ServerProcess, http: httpx.Client
) -> None:
    body = {
        "model": "smollm2-test",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 5,
        "api_key": "sk-in-the-body",
    }
    secret = {"authorization": "Bearer sk-not-for-the-console"}
    plain = http.post(
        "/v1/chat/completions", json=body, headers={"x-request-id": "console-detail-1", **secret}
    )
    assert plain.status_code == 200
    detail = http.get("/v1/argosy/requests/console-detail-1").json()
    assert detail["status"] == 200 and detail["route"] == "POST /v1/chat/completions"
    request, response = detail["exchange"]["request"], detail["exchange"]["response"]
    assert request["headers"]["authorization"] == "[redacted]"
    assert json.loads(request["body"])["messages"][0]["content"] == "Name a colour."
    assert json.loads(request["body"])["api_key"] == "[redacted]"
    assert "sk-not-for-the-console" not in json.dumps(detail) and "sk-in-the-body" not in json.dumps(detail)
    answer = plain.json()["choices"][0]["message"]["content"]
    assert json.loads(response["body"])["choices"][0]["message"]["content"] == answer
    assert response["headers"]["content-type"].startswith("application/json") and not response["truncated"]

    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"x-request-id": "console-detail-2"},
    ) as stream:
        streamed = b"".join(stream.iter_bytes())
    kept = http.get("/v1/argosy/requests/console-detail-2").json()["exchange"]["response"]
    assert kept["body"].encode() == streamed and kept["body"].rstrip().endswith("data: [DONE]")

    missing = http.get("/v1/argosy/requests/no-such-request")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_stats_history_is_the_servers_own(server: ServerProcess, http: httpx.Client) -> None:
    history = http.get("/v1/argosy/stats/history").json()
    assert history["interval_s"] == 5 and history["window_s"] == 60
    points = history["data"]
    assert points, "the server samples from its start"  # the first at start-up
    assert "smollm2-test" in points[-1]["models"] and "ttft_s" in points[-1]
    assert http.get(f"/v1/argosy/stats/history?since={points[-1]['time']}").json()["data"] == []
    assert http.get("/v1/argosy/stats/history?since=yesterday").status_code == 400
