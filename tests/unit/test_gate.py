"""The gate: keys and their policy, token buckets, client addresses behind proxies, and the
auth matrix over every route the app registers (read from its route table, so a new route
is covered by itself), in each dialect's error shape, with each 401 seen by the events.

The app's model never loads (its load blocks, then a request gets 503 "loading"): a 503
proves the gate and the policy let the request through, a 401/403 that they did not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.datastructures import Headers
from starlette.routing import Route
from starlette.testclient import TestClient

from argosy.api.app import build_app
from argosy.api.gate import Gate
from argosy.config import ModelSpec, ServerConfig
from argosy.core.events import EventBus, RequestEvent
from argosy.core.keys import KeyLimits, KeyPolicy, TokenBucket, key_hash, key_ring, load_keys_toml
from argosy.core.registry import ModelRegistry
from argosy.errors import InvalidRequestError
from tests.unit.blocked_load import BlockedLoad

KEYS_TOML = """
[[key]]
name = "alice"
key = "sk-alice"

[[key]]
name = "embedder"
key = "sk-embedder"
models = ["mini*"]

[[key]]
name = "old"
key = "sk-old"
expires = 2001-01-01T00:00:00Z

[[key]]
name = "slow"
key_sha256 = "{slow_sha}"
max_qos = "background"
requests_per_minute = 2
"""


def write_keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_TOML.replace("{slow_sha}", key_hash("sk-slow").hex()))
    return path


def test_keys_toml_policies(tmp_path: Path) -> None:
    policies = {p.name: p for p in load_keys_toml(write_keys(tmp_path))}
    assert set(policies) == {"alice", "embedder", "old", "slow"}
    assert policies["embedder"].allows_model(("minilm", "all-MiniLM-L6-v2"))
    assert not policies["embedder"].allows_model(("smollm2",))
    assert policies["alice"].allows_model(("anything",))
    assert policies["old"].is_expired() and not policies["alice"].is_expired()
    assert policies["slow"].allows_qos("inline") and not policies["slow"].allows_qos("interactive")
    ring = key_ring(["sk-flag"], None, str(write_keys(tmp_path)))
    assert ring.find("sk-slow") is policies["slow"] or ring.find("sk-slow").name == "slow"  # type: ignore[union-attr]
    assert ring.find("sk-flag").name == "key-1"  # type: ignore[union-attr]
    assert ring.find("sk-nope") is None
    assert all(b"sk-" not in repr(p).encode() for p in ring.policies)  # only hashes are kept


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('[[key]]\nkey = "x"\n', "'name' is required"),
        ('[[key]]\nname = "a"\n', "exactly one of 'key' and 'key_sha256'"),
        ('[[key]]\nname = "a"\nkey = "x"\nmodels = "all"\n', "'models' must be a list"),
        ('[[key]]\nname = "a"\nkey = "x"\nrequests_per_minute = -1\n', "positive number"),
        ('[[key]]\nname = "a"\nkey = "x"\nmax_qos = "urgent"\n', "'max_qos' must be one of"),
        ('[[key]]\nname = "a"\nkey = "x"\nexpires = "soon"\n', "not an RFC 3339"),
        ('[[key]]\nname = "a"\nkey = "x"\ncolour = 1\n', "unknown field(s) colour"),
        ('[[key]]\nname = "a"\nkey = "x"\n[[key]]\nname = "a"\nkey = "y"\n', "must be unique"),
        ("[[key]\n", "not valid TOML"),
    ],
)
def test_a_bad_keys_file_names_the_file_the_key_and_the_reason(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(InvalidRequestError) as bad:
        key_ring([], None, str(path))
    assert reason in bad.value.message
    assert bad.value.param == "api_keys"
    assert "must be unique" in reason or str(path) in bad.value.message


def test_token_buckets() -> None:
    bucket = TokenBucket(rate_per_minute=60, burst=2)
    assert bucket.take(now=0.0) == 0 and bucket.take(now=0.0) == 0
    assert bucket.take(now=0.0) == pytest.approx(1.0)  # one a second
    assert bucket.take(now=1.0) == 0
    tokens = TokenBucket(rate_per_minute=600, burst=600)
    tokens.spend(900, now=0.0)  # after the fact: into debt
    assert tokens.wait_for_positive(now=0.0) == pytest.approx(30.0, rel=1e-6)
    assert tokens.wait_for_positive(now=31.0) == 0


def test_key_limits_concurrency_and_tokens() -> None:
    limits = KeyLimits()
    policy = KeyPolicy("k", key_hash("k"), max_concurrent=1, tokens_per_minute=100)
    assert limits.admit(policy) is None
    assert limits.admit(policy) == ("max_concurrent", 1.0)
    limits.done(policy, 150)  # 150 tokens spent: 50 in debt
    refused = limits.admit(policy)
    assert refused is not None and refused[0] == "tokens_per_minute" and 25 < refused[1] <= 31


def test_client_address_behind_trusted_proxies() -> None:
    gate = Gate(key_ring([], None, None), trusted_proxies=["10.0.0.0/8"])
    forwarded = Headers({"x-forwarded-for": "6.6.6.6, 1.2.3.4, 10.0.0.7"})
    assert gate.client_address("10.0.0.1", forwarded) == "1.2.3.4"  # the right-most untrusted hop
    assert gate.client_address("5.5.5.5", forwarded) == "5.5.5.5"  # an untrusted peer: its header is ignored
    assert gate.client_address("10.0.0.1", Headers({})) == "10.0.0.1"


# -- the auth matrix over the app's own routes ------------------------------------------------

MODEL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"prompt": "hi"},
    "/api/show": {},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[TestClient, list[RequestEvent]]]:
    load = BlockedLoad()
    registry = ModelRegistry([ModelSpec("smollm2", "smollm2")], load, load_timeout_s=0.2)
    config = ServerConfig(api_key=["sk-flag"], api_keys=str(write_keys(tmp_path)))
    events: list[RequestEvent] = []
    app = build_app(registry, config, events=EventBus([events.append]))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, events
    load.released.set()


def routes(client: TestClient) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves (its included routers flattened; path
    parameters filled with 'x')."""
    found = []
    pending = list(client.app.router.routes)  # type: ignore[attr-defined]
    while pending:
        route = pending.pop(0)
        included = getattr(route, "original_router", None)
        if included is not None:
            pending += included.routes
            continue
        if not isinstance(route, Route) or route.path.startswith(("/openapi", "/docs", "/redoc")):
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.path_format)
        found += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return found


def assert_error_shape(path: str, response: Any, status: int) -> None:
    assert response.status_code == status, (path, response.text)
    body = response.json()
    if path.startswith("/api/"):
        assert isinstance(body["error"], str) and body["error"]
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] in (
            "authentication_error",
            "permission_error",
        )
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}


def call(client: TestClient, method: str, path: str, key: str | None, model: str = "smollm2") -> Any:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    body = {**MODEL_BODIES[path], "model": model} if path in MODEL_BODIES else {}
    return client.request(method, path, headers=headers, json=body if method in ("POST", "PUT") else None)


def test_every_route_needs_a_key_but_health_and_the_console_page(
    gated: tuple[TestClient, list[RequestEvent]],
) -> None:
    client, events = gated
    table = routes(client)
    assert ("GET", "/health") in table and ("POST", "/api/chat") in table and len(table) > 25
    refused = 0
    for method, path in table:
        if path == "/health":
            assert client.get("/health").status_code in (200, 503)  # open, whatever its state
            continue
        if path == "/console":  # the page holds no data: it asks for the key its reads send
            assert client.get("/console").headers["content-type"].startswith("text/html")
            continue
        for key in (None, "sk-wrong", "sk-old"):
            assert_error_shape(path, call(client, method, path, key), 401)
            refused += 1
        if path == "/v1/argosy/requests/stream":
            continue  # with the key it follows requests for ever (tests/e2e/test_console_browser.py)
        # the right key passes the gate: whatever the route says next is not about the key
        passed = call(client, method, path, "sk-alice")
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # an admin key's routes
            assert passed.status_code == 403 and passed.json()["error"]["code"] == "admin_key_required"
            continue
        assert passed.status_code not in (401, 403), (method, path, passed.text)
        if path in MODEL_BODIES:
            assert passed.status_code in (503, 529), (method, path, passed.text)  # on to load the model
            # a key without this model: 403 before anything loads
            assert_error_shape(path, call(client, method, path, "sk-embedder"), 403)
    unauthorized = [e for e in events if e.kind == "finished" and e.status == 401]
    assert len(unauthorized) == refused  # the observer recorded each 401
    assert all(e.error_kind == "unauthorized" and e.key_name is None for e in unauthorized)
    loading = [
        e for e in events if e.kind == "finished" and e.status in (503, 529) and e.route != "GET /health"
    ]
    assert {e.key_name for e in loading} == {"alice"}


def test_keys_in_either_header_and_the_qos_ceiling(gated: tuple[TestClient, list[RequestEvent]]) -> None:
    client, events = gated
    chat = {**MODEL_BODIES["/v1/chat/completions"], "model": "smollm2"}
    assert client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sk-flag"}).status_code == 503
    # slow's highest class is background: asking interactive is refused, asking nothing runs at its highest
    slow = {"authorization": "Bearer sk-slow"}
    asked = client.post("/v1/chat/completions", json={**chat, "priority": "interactive"}, headers=slow)
    assert asked.status_code == 403 and asked.json()["error"]["code"] == "qos_not_allowed"
    assert client.post("/v1/chat/completions", json=chat, headers=slow).status_code == 503
    # slow may send 2 requests a minute: the third is a 429 with Retry-After
    third = client.get("/v1/models", headers=slow)
    assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
    assert third.json()["error"]["type"] == "rate_limit_error"
    anthropic = client.post("/v1/messages/count_tokens", json={}, headers=slow)
    assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
    assert client.get("/api/tags", headers=slow).json() == {
        "error": "The API key's requests_per_minute limit is reached."
    }
    assert "sk-" not in repr(events)  # a key is never in an event


def test_per_address_limit_and_small_bodies(tmp_path: Path) -> None:
    registry = ModelRegistry([ModelSpec("smollm2", "smollm2")], BlockedLoad(), load_timeout_s=0.2)
    config = ServerConfig(rate_limit_per_minute=60, burst=2, max_small_body_bytes=64)
    with TestClient(build_app(registry, config), raise_server_exceptions=False) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models").status_code == 200
        limited = client.get("/api/tags")
        assert limited.status_code == 429 and limited.headers["retry-after"] == "1"
        assert "Too many requests from testclient" in limited.json()["error"]
        assert client.get("/health").status_code in (200, 503)  # never limited
    with TestClient(build_app(registry, config), raise_server_exceptions=False) as client:
        big = client.post("/api/pull", content=b"{" + b" " * 100 + b"}")  # a small route: 64 bytes
        assert big.status_code == 413 and isinstance(big.json()["error"], str)
        chat = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 100}]}
        )
        assert chat.status_code == 503  # a generation route takes the large limit: on to the model


def test_cors_is_off_unless_origins_are_allowed() -> None:
    registry = ModelRegistry([ModelSpec("smollm2", "smollm2")], BlockedLoad(), load_timeout_s=0.2)
    with TestClient(build_app(registry, ServerConfig()), raise_server_exceptions=False) as client:
        response = client.get("/v1/models", headers={"origin": "https://app.example"})
        assert "access-control-allow-origin" not in response.headers
    config = ServerConfig(allowed_origins=["https://app.example"], api_key=["sk"])
    with TestClient(build_app(registry, config), raise_server_exceptions=False) as client:
        preflight = client.options(
            "/v1/chat/completions",
            headers={"origin": "https://app.example", "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 200  # answered before the gate: browsers send no key
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/v1/models", headers={"origin": "https://evil.example", "x-api-key": "sk"})
        assert "access-control-allow-origin" not in other.headers


def test_a_public_host_needs_a_key_or_insecure() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        ServerConfig(host="0.0.0.0")
    assert refused.value.param == "insecure"
    ServerConfig(host="0.0.0.0", insecure=True)
    ServerConfig(host="0.0.0.0", api_key=["sk"])
    ServerConfig(host="::1")


def test_websockets_pass_the_same_gate(gated: tuple[TestClient, list[RequestEvent]]) -> None:
    """The realtime WebSocket needs the key as every route does: without one it is closed
    before it opens (1008, the reason said); with one (header or a browser's subprotocol) it
    reaches the route, here refused for want of a transcription model."""
    from starlette.websockets import WebSocketDisconnect

    client, _ = gated
    path = "/v1/audio/transcriptions/realtime"
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect(path):
        pass
    assert refused.value.code == 1008 and "Missing API key" in refused.value.reason
    with (
        pytest.raises(WebSocketDisconnect) as refused,
        client.websocket_connect(path, headers={"x-api-key": "wrong"}),
    ):
        pass
    assert refused.value.code == 1008 and refused.value.reason == "Invalid API key."
    for kwargs in (
        {"headers": {"authorization": "Bearer sk-flag"}},
        {"subprotocols": ["openai-insecure-api-key.sk-flag"]},
    ):
        with pytest.raises(WebSocketDisconnect) as reached, client.websocket_connect(path, **kwargs):  # type: ignore[arg-type]
            pass
        assert (
            reached.value.code == 1008
            and reached.value.reason == "This server serves no transcription model."
        )
