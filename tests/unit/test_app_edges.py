"""The HTTP edge without a model: every refusal that needs no model, in OpenAI's envelope.

The app is built around a registry whose model never finishes loading (its load blocks until
the test ends; a request waits 0.3 s for it, then gets 503 "loading"), so a 400/404/405/413
here proves the refusal came first, as SPEC §4 "cheap checks first" asks — and the registry
says whether a load was even started.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from argosy.api.app import build_app
from argosy.config import ModelSpec, OperatorSampling, ServerConfig
from argosy.core.events import EventBus, RequestEvent
from argosy.core.pipeline import Pipeline, RequestContext
from argosy.core.registry import ArrivalGroup, ModelRegistry
from argosy.engine.arrivals import Arrival
from argosy.errors import InvalidRequestError
from tests.unit.blocked_load import BlockedLoad

LIMIT = 4096
GOOD_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


SERVER = ServerConfig(max_body_bytes=LIMIT, operator_sampling=OperatorSampling(temperature=0.5))


@pytest.fixture
def load() -> Iterator[BlockedLoad]:
    blocked = BlockedLoad()
    yield blocked
    blocked.released.set()


@pytest.fixture
def registry(load: BlockedLoad) -> ModelRegistry:
    return ModelRegistry(
        [ModelSpec("smollm2", "smollm2")],
        load,
        load_timeout_s=0.3,
        operator_sampling=SERVER.operator_sampling,
    )


@pytest.fixture
def client(registry: ModelRegistry) -> Iterator[TestClient]:
    with TestClient(build_app(registry, SERVER), raise_server_exceptions=False) as test_client:
        yield test_client


def assert_openai_error(
    response: Any, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_health_is_503_while_loading(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "loading", "models": {"smollm2": "unloaded"}}


def test_a_good_request_while_loading_is_503(client: TestClient) -> None:
    error = assert_openai_error(
        client.post("/v1/chat/completions", json=GOOD_CHAT), 503, code="model_loading"
    )
    assert error["type"] == "server_error"
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


def test_schema_errors_come_before_the_model(client: TestClient, load: BlockedLoad) -> None:
    bad = {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}
    assert_openai_error(client.post("/v1/chat/completions", json=bad), 400, "messages[0].role")
    assert_openai_error(client.post("/v1/chat/completions", json={**GOOD_CHAT, "n": 17}), 400, "n")
    # whether a model has FIM tokens needs the model; a suffix after token ids never works
    assert_openai_error(client.post("/v1/completions", json={"prompt": [1, 2], "suffix": "y"}), 400, "suffix")
    tool_choice = {**GOOD_CHAT, "tool_choice": "required"}
    assert_openai_error(client.post("/v1/chat/completions", json=tool_choice), 400, "tool_choice")
    assert load.calls == []  # no refusal above started a load


def test_null_means_the_default(client: TestClient) -> None:
    """OpenAI reads a field sent as null as a field not sent: these pass validation and reach
    the model (503: still loading), where `"stream": "yes"` does not."""
    nulls = {"stream": None, "n": None, "logprobs": None, "store": None, "stream_options": None}
    assert client.post("/v1/chat/completions", json={**GOOD_CHAT, **nulls}).status_code == 503
    assert (
        client.post("/v1/completions", json={"prompt": "x", "echo": None, "stream": None}).status_code == 503
    )
    responses = {"model": "smollm2", "input": "x", "stream": None, "store": None, "temperature": None}
    assert client.post("/v1/responses", json=responses).status_code == 503
    assert_openai_error(
        client.post("/v1/chat/completions", json={**GOOD_CHAT, "stream": "yes"}), 400, "stream"
    )


def test_malformed_json(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"


def test_unknown_model_is_404_before_loading(client: TestClient, load: BlockedLoad) -> None:
    response = client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-9"})
    error = assert_openai_error(response, 404, "model", "model_not_found")
    assert "gpt-9" in error["message"]
    assert load.calls == []


def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    error = assert_openai_error(client.post("/v1/nothing", json={}), 404, code="unknown_url")
    assert "POST /v1/nothing" in error["message"]
    response = client.get("/v1/chat/completions")
    assert_openai_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]


def test_body_over_the_limit_by_content_length(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", content=b"x" * (LIMIT + 1))
    assert_openai_error(response, 413)


def test_streamed_body_over_the_limit(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(8):
            yield b"x" * 1024

    response = client.post("/v1/chat/completions", content=chunks())
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)


def test_request_ids(client: TestClient) -> None:
    assert client.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = client.post("/v1/nothing").headers["x-request-id"]
    assert generated.startswith("req-")
    assert client.get("/health", headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"] != (
        "bad id with spaces"
    )


def test_models_while_loading(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == "smollm2"
    assert model["capabilities"]["loaded"] is False
    assert model["capabilities"]["context_length"] is None
    assert model["capabilities"]["sampling_defaults"] == {"temperature": 0.5}  # only what the operator pins
    assert model["capabilities"]["default_max_tokens"] is None  # no operator default: to the context's end
    assert client.get("/v1/models/smollm2").json()["id"] == "smollm2"
    assert_openai_error(client.get("/v1/models/other"), 404, code="model_not_found")


def test_engine_stats_while_loading(client: TestClient) -> None:
    assert_openai_error(client.get("/v1/argosy/engine"), 400, "model")


def test_a_failed_load(load: BlockedLoad, registry: ModelRegistry) -> None:
    load.released.set()  # the load fails at once
    app = build_app(registry, SERVER)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        error = assert_openai_error(test_client.post("/v1/chat/completions", json=GOOD_CHAT), 500)
        assert "no such file" in error["message"]
        assert test_client.get("/health").json() == {"status": "failed", "models": {"smollm2": "failed"}}
        info = test_client.get("/v1/models/smollm2").json()["capabilities"]
        assert info["state"] == "failed" and "no such file" in info["error"]


def test_generation_posts_are_counted_as_arriving_until_they_end(registry: ModelRegistry) -> None:
    """ArrivalMiddleware: POSTs to generation routes count as arriving at the engine (here
    the model is still loading, so each ends with a 503 and is marked done); other routes
    and methods are not counted."""
    counted: list[str] = []
    finished: list[str] = []

    def arriving() -> ArrivalGroup:
        name = f"arrival-{len(counted)}"
        counted.append(name)
        return ArrivalGroup({"smollm2": Arrival(lambda: finished.append(name))})

    registry.arriving = arriving  # type: ignore[method-assign]
    with TestClient(build_app(registry, SERVER), raise_server_exceptions=False) as test_client:
        assert test_client.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 503
        assert (
            test_client.post("/v1/completions", json={"model": "smollm2", "prompt": "x"}).status_code == 503
        )
        assert test_client.get("/v1/models").status_code == 200
        assert test_client.get("/v1/chat/completions").status_code == 405
        assert test_client.post("/v1/nowhere", json={}).status_code == 404
    assert counted == finished == ["arrival-0", "arrival-1"]


def test_the_policy_hook_and_every_requests_events(registry: ModelRegistry) -> None:
    """The policy hook runs once the model is resolved, before it loads (a refusal there
    loads nothing), seeing the request's QoS class; every request — refused, unknown, /health — has a started and a finished event, the
    finished one with its status, route template, dialect and the refusal's kind and words."""
    events: list[RequestEvent] = []
    asked: list[str | None] = []

    def policy(ctx: RequestContext, spec: ModelSpec) -> None:
        asked.append(ctx.key_name)
        if ctx.qos == "background":
            raise InvalidRequestError("This key may not use that model.", param="model")

    pipeline = Pipeline(registry, policy=policy)
    app = build_app(registry, SERVER, pipeline=pipeline, events=EventBus([events.append]))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        bad_role = {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}
        assert test_client.post("/v1/chat/completions", json=bad_role).status_code == 400
        refused = test_client.post("/v1/chat/completions", json={**GOOD_CHAT, "priority": "background"})
        assert refused.status_code == 400
        assert (
            test_client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-9"}).status_code == 404
        )
        assert test_client.get("/health").status_code == 503  # the model is not loaded
        assert test_client.post("/api/nowhere", json={}).status_code == 404
    assert asked == [None]  # not the malformed body, nor the unknown model (404 first); no key
    assert [e.kind for e in events] == ["started", "finished"] * 5
    finished = [e for e in events if e.kind == "finished"]
    assert [(e.status, e.route, e.dialect, e.error_kind) for e in finished] == [
        (400, "POST /v1/chat/completions", "openai", "invalid_request"),
        (400, "POST /v1/chat/completions", "openai", "invalid_request"),
        (404, "POST /v1/chat/completions", "openai", "not_found"),
        (503, "GET /health", "argosy", None),
        (404, "POST /api/nowhere", "ollama", "not_found"),
    ]
    assert finished[1].error == "This key may not use that model."
    assert finished[2].model_id is None  # an unknown model's name never becomes a field
    assert all(e.request_id.startswith("req-") and e.duration_s >= 0 for e in finished)
    assert registry.entries[0].state == "unloaded"


def test_the_openapi_document_lists_every_route_with_its_body(client: TestClient) -> None:
    """GET /openapi.json: every route the app registers, each model route's request body from
    its pydantic model, SSE where it streams, the error envelope on 4XX/5XX; and schemathesis
    (the fuzzer in tests/faults/test_fuzz.py) can build every operation from it."""
    import schemathesis

    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    documented = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert documented == {
        ("/health", "get"),
        ("/v1/argosy/engine", "get"),
        ("/metrics", "get"),
        ("/v1/metrics", "get"),
        ("/v1/models", "get"),
        ("/v1/models/{model_id}", "get"),
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/embeddings", "post"),
        ("/v1/rerank", "post"),
        ("/rerank", "post"),
        ("/v2/rerank", "post"),
        ("/v1/score", "post"),
        ("/v1/load_lora_adapter", "post"),
        ("/v1/unload_lora_adapter", "post"),
        ("/lora-adapters", "get"),
        ("/v1/audio/transcriptions", "post"),
        ("/v1/audio/translations", "post"),
        ("/v1/audio/speech", "post"),
        ("/v1/audio/models", "get"),
        ("/v1/audio/models/{model_id}", "get"),
        ("/v1/audio/models", "post"),
        ("/v1/audio/models/{model_id}", "delete"),
        ("/v1/audio/generate", "post"),
        ("/v1/images/generations", "post"),
        ("/v1/images/edits", "post"),
        ("/v1/argosy/models/{model_id}/load", "post"),
        ("/v1/argosy/requests", "get"),
        ("/v1/argosy/requests/{request_id}", "get"),
        ("/v1/argosy/sessions", "get"),
        ("/v1/argosy/sessions/{session_id}", "get"),
        ("/v1/argosy/sessions/{session_id}/fork", "post"),
        ("/v1/argosy/stats", "get"),
        ("/v1/argosy/stats/history", "get"),
        ("/v1/argosy/models/{model_id}/unload", "post"),
        ("/v1/audio/jobs/{job_id}", "get"),
        ("/v1/audio/jobs/{job_id}", "delete"),
        ("/v1/audio/jobs/{job_id}/result", "get"),
        ("/tokenize", "post"),
        ("/detokenize", "post"),
        ("/tokenizer_info", "get"),
        ("/v1/responses", "post"),
        ("/v1/responses/{response_id}", "get"),
        ("/v1/responses/{response_id}", "delete"),
        ("/v1/responses/{response_id}/cancel", "post"),
        ("/v1/responses/{response_id}/input_items", "get"),
        ("/v1/argosy/responses/{response_id}/prompt", "get"),
        ("/v1/messages", "post"),
        ("/v1/messages/count_tokens", "post"),
        ("/api/chat", "post"),
        ("/api/generate", "post"),
        ("/api/show", "post"),
        ("/api/embed", "post"),
        ("/api/embeddings", "post"),
        ("/api/tags", "get"),
        ("/api/ps", "get"),
        ("/api/version", "get"),
        ("/api/pull", "post"),
        ("/api/push", "post"),
        ("/api/create", "post"),
        ("/api/copy", "post"),
        ("/api/delete", "delete"),
    }
    schemas = document["components"]["schemas"]
    for path, model in [
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/responses", "ResponsesRequest"),
        ("/v1/embeddings", "EmbeddingRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
        ("/api/chat", "ChatRequest"),
        ("/api/generate", "GenerateRequest"),
        ("/api/embed", "EmbedRequest"),
    ]:
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and "properties" in schemas[model]
        media = set(operation["responses"]["200"]["content"])
        streams = {"/api/chat": "application/x-ndjson", "/api/generate": "application/x-ndjson"}.get(
            path,
            "text/event-stream"
            if path not in ("/v1/embeddings", "/v1/messages/count_tokens", "/api/embed")
            else None,
        )
        assert media == ({"application/json", streams} if streams else {"application/json"})
        envelopes = {"/v1/messages": "/AnthropicError", "/api/": "/OllamaError"}
        envelope = next((e for prefix, e in envelopes.items() if path.startswith(prefix)), "/Error")
        for statuses in ("4XX", "5XX"):
            schema = operation["responses"][statuses]["content"]["application/json"]["schema"]
            assert schema["$ref"].endswith(envelope)
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert {"messages", "max_tokens"} <= set(schemas["MessagesRequest"]["required"])
    assert "max_tokens" not in schemas["CountTokensRequest"].get("required", [])
    params = {
        p["name"] for p in document["paths"]["/v1/responses/{response_id}/input_items"]["get"]["parameters"]
    }
    assert params == {"response_id", "order", "limit", "after"}
    operations = [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]
    assert len(operations) == len(documented)


def test_audio_and_image_routes_without_such_a_model_name_the_missing_kind(
    client: TestClient, load: BlockedLoad
) -> None:
    wav = b"RIFF" + b"\0" * 64
    response = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav)})
    assert_openai_error(response, 400, "model")
    assert response.json()["error"]["message"] == "This server serves no transcription model."
    response = client.post(
        "/v1/audio/translations", files={"file": ("a.wav", wav)}, data={"model": "smollm2"}
    )
    assert_openai_error(response, 400, "model", "wrong_model_kind")
    response = client.post("/v1/audio/speech", json={"input": "Hello.", "voice": "alloy"})
    assert response.json()["error"]["message"] == "This server serves no speech model."
    # the cheap checks come first: no file, a file where text belongs, a bad field
    assert_openai_error(client.post("/v1/audio/transcriptions", data={"model": "x"}), 400, "file")
    response = client.post(
        "/v1/audio/transcriptions", files={"file": ("a.wav", wav), "prompt": ("p.txt", b"x")}
    )
    assert_openai_error(response, 400, "prompt")
    response = client.post(
        "/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data={"temperature": "hot"}
    )
    assert_openai_error(response, 400, "temperature")
    assert_openai_error(
        client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "joe", "speed": 0}), 400, "speed"
    )
    assert client.get("/v1/audio/models").json() == {"object": "list", "data": []}
    response = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert response.json()["error"]["message"] == "This server serves no image model."
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "9x9"})
    assert_openai_error(response, 400, "size")
    assert load.calls == []
