"""Issue 38's contracts that need no model: SSE keep-alive framing, every unhonoured field
named, the reference's audio model routes, tool_choice / json_schema shorthands, repeat
penalty 0, immediate 503 past the load slots, and reasoning.summary checked."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from argosy.api.app import build_app
from argosy.api.framing import KEEPALIVE_FRAME, sse_frames
from argosy.api.openai.chat import ChatCompletionRequest
from argosy.api.openai.common import render_error
from argosy.api.openai.completions import CompletionRequest
from argosy.api.openai.responses.request import ResponsesRequest
from argosy.config import ModelSpec, OperatorSampling, ServerConfig
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.errors import InvalidRequestError, ModelUnavailableError
from argosy.sampling_params import ModelSamplingDefaults, RequestSampling, resolve_sampling

USER = [{"role": "user", "content": "hi"}]


# -- 1. keep-alive framing -------------------------------------------------------------------


def test_a_none_chunk_is_a_keepalive_comment_and_the_stream_still_ends_with_done() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any] | None]:
        yield None
        yield {"a": 1}
        yield None

    async def frames() -> list[bytes]:
        return [frame async for frame in sse_frames(chunks(), render_error)]

    assert asyncio.run(frames()) == [
        KEEPALIVE_FRAME,
        b'data: {"a":1}\n\n',
        KEEPALIVE_FRAME,
        b"data: [DONE]\n\n",
    ]
    assert KEEPALIVE_FRAME == b": keep-alive\n\n"  # an SSE comment: clients skip it


def test_the_keepalive_interval_is_a_server_flag_and_0_is_off() -> None:
    assert ServerConfig().sse_keepalive_s == 15.0
    assert ServerConfig(sse_keepalive_s=0).sse_keepalive_s == 0
    with pytest.raises(InvalidRequestError) as caught:
        ServerConfig(sse_keepalive_s=-1)
    assert caught.value.param == "sse_keepalive_s"


# -- 2. every unhonoured field named -----------------------------------------------------------


def test_unknown_fields_on_chat_and_completions_are_named() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": USER, "fim_mode": "x", "frobnicate": 1, "repeat_penalty": 1.1, "enable_thinking": False}
    )
    assert chat.degraded_fields() == [
        "fim_mode",
        "frobnicate",
    ]  # repeat_penalty and enable_thinking are known
    completion = CompletionRequest.model_validate({"prompt": "a", "fim_modes": "psm", "echo": False})
    assert completion.degraded_fields() == ["fim_modes"]
    responses = ResponsesRequest.model_validate({"input": "a", "frobnicate": 1})
    assert responses.degraded_fields() == ["frobnicate"]


def test_top_level_enable_thinking_is_a_template_variable_and_chat_template_kwargs_wins() -> None:
    plain = ChatCompletionRequest.model_validate({"messages": USER, "enable_thinking": False})
    assert plain.chat_input().template_kwargs == {"enable_thinking": False}
    both = ChatCompletionRequest.model_validate(
        {"messages": USER, "enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert both.chat_input().template_kwargs == {"enable_thinking": True}


# -- 4. semantics ------------------------------------------------------------------------------


def test_repeat_penalty_0_is_off() -> None:
    for name in ("repeat_penalty", "repetition_penalty"):
        body = ChatCompletionRequest.model_validate({"messages": USER, name: 0})
        request = body.request_sampling(max_tokens=4, logprobs=None)
        assert request.repetition_penalty == 0
        operator = OperatorSampling(repetition_penalty=1.3)  # off wins over the operator's default too
        resolved = resolve_sampling(
            request, operator, ModelSamplingDefaults(), context_length=64, prompt_len=4
        )
        assert resolved.repetition_penalty == 1.0
    with pytest.raises(Exception, match="repetition_penalty"):
        ChatCompletionRequest.model_validate({"messages": USER, "repetition_penalty": -0.1})
    assert (
        resolve_sampling(
            RequestSampling(), OperatorSampling(), ModelSamplingDefaults(), context_length=64, prompt_len=4
        ).repetition_penalty
        == 1.0
    )


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": {"name": "f"}},  # OpenAI's
        {"name": "f"},  # the shorthand
        {"type": "function", "name": "f"},  # the Responses API's shape
    ],
)
def test_tool_choice_names_a_function_in_every_spelling(choice: dict[str, Any]) -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": choice})
    body.check()
    assert (body.chat_input().tool_choice.mode, body.chat_input().tool_choice.name) == ("named", "f")
    responses = ResponsesRequest.model_validate(
        {"input": "a", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"name": "f"}}
    )
    assert responses.neutral_tool_choice().name == "f"


def test_tool_choice_that_names_nothing_is_still_a_400() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "x"}}
    )
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    assert caught.value.param == "tool_choice"


def test_a_json_schema_carried_inline_is_the_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inline = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, **schema}}
    form = ChatCompletionRequest.model_validate({"messages": USER, "response_format": inline}).chat_input()
    assert form.output_format is not None
    assert (form.output_format.schema, form.output_format.name, form.output_format.strict) == (
        schema,
        "x",
        True,
    )
    nested = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    form = ChatCompletionRequest.model_validate({"messages": USER, "response_format": nested}).chat_input()
    assert form.output_format is not None and form.output_format.schema == schema
    bare = {"type": "json_schema", "json_schema": {"name": "x"}}  # no schema at all: as before
    form = ChatCompletionRequest.model_validate({"messages": USER, "response_format": bare}).chat_input()
    assert form.output_format is not None and form.output_format.schema is None


# -- 5. reasoning.summary ----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["summary", "generate_summary"])
def test_an_invalid_reasoning_summary_is_a_400_naming_it(key: str) -> None:
    body = ResponsesRequest.model_validate({"input": "a", "reasoning": {key: "verbose"}})
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    assert caught.value.param == f"reasoning.{key}"


def test_a_valid_reasoning_summary_is_echoed_and_named_degraded() -> None:
    body = ResponsesRequest.model_validate({"input": "a", "reasoning": {"summary": "concise"}})
    body.check()
    assert body.echo("m", 0)["reasoning"] == {"effort": None, "summary": "concise"}
    assert "reasoning.summary" in body.degraded_fields()
    plain = ResponsesRequest.model_validate({"input": "a"})
    assert plain.echo("m", 0)["reasoning"] == {"effort": None, "summary": None}
    assert plain.degraded_fields() == []


# -- 3. audio model management and 4. load slots (a registry with fake models) ------------------


class FakeModel:
    def __init__(self, spec: ModelSpec) -> None:
        self.model_id = spec.id
        self.kind = spec.kind
        self.is_alive = True

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return ModelInfo(
            id=self.model_id,
            created=0,
            kind=self.kind,
            state=state,
            is_loaded=True,
            context_length=64,
            architecture="Fake",
            dtype="float32",
            quantization=None,
            has_chat_template=False,
            sampling_defaults={},
        )

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self.is_alive = False


class GatedLoads:
    """Loads that wait for `gate` (set: they go at once)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.log: list[str] = []

    def __call__(self, spec: ModelSpec) -> FakeModel:
        self.gate.wait(10)
        self.log.append(spec.id)
        return FakeModel(spec)


@pytest.fixture
def loads() -> Iterator[GatedLoads]:
    gated = GatedLoads()
    yield gated
    gated.gate.set()


def test_a_load_past_every_busy_slot_is_503_at_once_while_one_for_the_loading_model_waits(
    loads: GatedLoads,
) -> None:
    async def main() -> None:
        specs = [ModelSpec(name, name) for name in ("a", "b", "c")]
        registry = ModelRegistry(specs, loads, max_concurrent_loads=1, load_timeout_s=30.0)
        loads.gate.clear()
        loading_a = asyncio.ensure_future(registry.acquire(registry.resolve("a")))
        await asyncio.sleep(0.05)
        same_model = asyncio.ensure_future(registry.acquire(registry.resolve("a")))  # joins a's load
        started = asyncio.get_running_loop().time()
        with pytest.raises(ModelUnavailableError) as caught:
            await registry.acquire(registry.resolve("b"))  # would need a second load
        assert asyncio.get_running_loop().time() - started < 1.0  # at once, not after 30 s
        assert caught.value.retry_after_s >= 1 and caught.value.kind == "model_loading"
        assert registry.resolve("b").state == "unloaded"
        loads.gate.set()
        (await loading_a).release()
        (await same_model).release()
        (await registry.acquire(registry.resolve("b"))).release()  # a slot is free again

    asyncio.run(main())
    assert loads.log == ["a", "b"]


def test_the_servers_own_work_waits_for_a_load_slot_instead(loads: GatedLoads) -> None:
    """An audio job run again after a restart has no client to retry: it queues for the slot."""

    async def main() -> None:
        specs = [ModelSpec(name, name) for name in ("a", "b")]
        registry = ModelRegistry(specs, loads, max_concurrent_loads=1, load_timeout_s=30.0)
        loads.gate.clear()
        loading_a = asyncio.ensure_future(registry.acquire(registry.resolve("a")))
        await asyncio.sleep(0.05)
        queued_b = asyncio.ensure_future(registry.acquire(registry.resolve("b"), queue_for_slot=True))
        await asyncio.sleep(0.05)
        assert not queued_b.done() and registry.resolve("b").state == "loading"
        loads.gate.set()
        (await loading_a).release()
        (await queued_b).release()

    asyncio.run(main())
    assert loads.log == ["a", "b"]


@pytest.fixture
def audio_client(loads: GatedLoads) -> Iterator[TestClient]:
    registry = ModelRegistry(
        [ModelSpec("chat", "chat"), ModelSpec("tts", "tts", kind="speech", aliases=("tts-1",))], loads
    )
    with TestClient(
        build_app(registry, ServerConfig(), preloaded=[]), raise_server_exceptions=False
    ) as client:
        yield client


def test_audio_models_load_and_unload_at_the_reference_paths(audio_client: TestClient) -> None:
    assert audio_client.get("/v1/audio/models/tts").json()["capabilities"]["state"] == "unloaded"
    loaded = audio_client.post("/v1/audio/models", json={"model": "tts-1"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["id"] == "tts" and loaded.json()["capabilities"]["state"] == "loaded"
    unloaded = audio_client.delete("/v1/audio/models/tts")
    assert unloaded.json() == {"id": "tts", "object": "model", "unloaded": True, "state": "unloaded"}
    again = audio_client.delete("/v1/audio/models/tts-1")
    assert again.json() == {"id": "tts", "object": "model", "unloaded": False, "state": "unloaded"}


def test_audio_model_routes_refuse_what_is_not_an_audio_model(audio_client: TestClient) -> None:
    chat = audio_client.post("/v1/audio/models", json={"model": "chat"})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "not_audio_model"
    assert chat.json()["error"]["param"] == "model"
    assert audio_client.post("/v1/audio/models", json={"model": "nope"}).status_code == 404
    assert audio_client.post("/v1/audio/models", json={}).json()["error"]["param"] == "model"
    assert audio_client.delete("/v1/audio/models/chat").status_code == 404
    assert audio_client.delete("/v1/audio/models/nope").status_code == 404


def test_audio_model_routes_need_a_key_as_the_generic_ones_do(loads: GatedLoads) -> None:
    registry = ModelRegistry([ModelSpec("chat", "chat"), ModelSpec("tts", "tts", kind="speech")], loads)
    app = build_app(registry, ServerConfig(api_key=["secret"]), preloaded=[])
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path, body in (
            ("POST", "/v1/audio/models", {"model": "tts"}),
            ("DELETE", "/v1/audio/models/tts", None),
            ("POST", "/v1/argosy/models/tts/load", None),
        ):
            assert client.request(method, path, json=body).status_code == 401
        authorized = {"authorization": "Bearer secret"}
        assert client.post("/v1/audio/models", json={"model": "tts"}, headers=authorized).status_code == 200
        assert client.delete("/v1/audio/models/tts", headers=authorized).status_code == 200


def test_the_openapi_document_has_the_new_routes_and_fields(audio_client: TestClient) -> None:
    document = audio_client.get("/openapi.json").json()
    assert "post" in document["paths"]["/v1/audio/models"]
    assert "delete" in document["paths"]["/v1/audio/models/{model_id}"]
    schemas = document["components"]["schemas"]
    assert "enable_thinking" in schemas["ChatCompletionRequest"]["properties"]
    assert "metadata" in schemas["ChatCompletionRequest"]["properties"]
    assert schemas["AudioModelLoad"]["required"] == ["model"]
