"""Request validation -> OpenAI errors: which field is named (`param`), status and envelope."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from argosy.api.errors import (
    ERROR_TABLE,
    APIError,
    from_validation_error,
    openai_error_body,
    param_from_loc,
    status_of,
)
from argosy.api.openai.chat import ChatCompletionRequest
from argosy.api.openai.completions import CompletionRequest
from argosy.api.transport import payload_too_large
from argosy.errors import (
    ArgosyError,
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
)

USER = [{"role": "user", "content": "hi"}]


def chat_error(body: dict[str, Any] | str) -> InvalidRequestError:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(Exception) as caught:
        ChatCompletionRequest.model_validate_json(raw)
    return from_validation_error(caught.value)  # type: ignore[arg-type]


def completion_error(body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(Exception) as caught:
        CompletionRequest.model_validate_json(json.dumps(body))
    return from_validation_error(caught.value)  # type: ignore[arg-type]


def test_param_from_loc() -> None:
    assert param_from_loc(("messages", 0, "role")) == "messages[0].role"
    assert param_from_loc(("stream_options", "include_usage")) == "stream_options.include_usage"
    assert param_from_loc(("n",)) == "n"
    assert param_from_loc(()) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [*USER, {"role": "robot", "content": "x"}]}, "messages[1].role"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": -5}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": 17}, "n"),
        ({"messages": USER, "temperature": 2.5}, "temperature"),
        ({"messages": USER, "temperature": -0.1}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.5}, "top_p"),
        ({"messages": USER, "min_p": 1.5}, "min_p"),
        ({"messages": USER, "top_k": -2}, "top_k"),
        ({"messages": USER, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": USER, "repetition_penalty": -0.5}, "repetition_penalty"),
        ({"messages": USER, "repeat_penalty": -1}, "repeat_penalty"),
        ({"messages": USER, "logit_bias": {"5": 150}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"five": 1}}, "logit_bias"),
        ({"messages": USER, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": USER, "stop": ["a", 1]}, "stop"),
        ({"messages": USER, "max_tokens": "10"}, "max_tokens"),  # strict: a string is not a number
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": [{"role": "user"}], "seed": 2**70}, "seed"),
    ],
)
def test_chat_field_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    body = {"model": "m", **body}
    error = chat_error(body)
    assert error.param == param, error.message
    assert status_of(error) == 400
    assert error.message.startswith(("Invalid '", "Missing required parameter")), error.message


def test_messages_required_says_missing() -> None:
    assert chat_error({"model": "m"}).message == "Missing required parameter: 'messages'."


def content_error(messages: list[dict[str, Any]]) -> InvalidRequestError:
    """Content parts are read by the request's check (which knows each message's index)."""
    body = ChatCompletionRequest.model_validate_json(json.dumps({"model": "m", "messages": messages}))
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    return caught.value


def test_media_part_names_the_part_and_the_modality() -> None:
    """An image part is read when the request is (a bad one: a 400 naming it; whether the model
    reads images is the model's to say, core/vision.py); audio is refused at once."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    error = content_error([*USER, {"role": "user", "content": [part]}])
    assert error.param == "messages[1].content[0]"
    assert "is not an image this server can read" in error.message
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    error = content_error([*USER, {"role": "user", "content": [audio]}])
    assert error.param == "messages[1].content[0]" and "does not accept audio" in error.message
    png = {
        "type": "image_url",
        "image_url": {
            "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="
        },
    }
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [png]}]}
    )
    body.check()
    assert [(image.where, image.width) for image in body.chat_input().images] == [
        ("messages[0].content[0]", 2)
    ]


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (5, "messages[1].content"),
        ({"type": "text"}, "messages[1].content"),
        ([{"type": "video", "x": 1}], "messages[1].content[0].type"),
        ([{"type": {}, "text": "x"}], "messages[1].content[0].type"),  # was a 500 (unhashable type)
        ([{"type": ["text"]}], "messages[1].content[0].type"),
        ([{"text": "x"}], "messages[1].content[0].type"),
        (["just text"], "messages[1].content[0].type"),
        ([{"type": "text", "text": "ok"}, {"type": "text", "text": {}}], "messages[1].content[1]"),
    ],
)
@pytest.mark.parametrize("role", ["user", "system", "assistant", "tool"])
def test_malformed_content_parts_are_400_naming_the_part(content: Any, param: str, role: str) -> None:
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    error = content_error([*USER, message])
    assert error.param == param and status_of(error) == 400


def test_malformed_json_is_a_400_without_param() -> None:
    for raw in ('{"messages": [', "not json", ""):
        error = chat_error(raw)
        assert error.param is None
        assert "could not parse the JSON body" in error.message


def test_a_body_that_is_not_an_object() -> None:
    error = chat_error("[1, 2]")
    assert error.param is None
    assert status_of(error) == 400


def test_the_shown_input_is_in_the_message() -> None:
    assert "(got 0)" in chat_error({"messages": USER, "max_tokens": 0}).message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1, 2], ["a"]]}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "best_of": 0}, "best_of"),
        ({}, "prompt"),
    ],
)
def test_completion_field_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    assert completion_error({"model": "m", **body}).param == param


def test_completion_prompt_shapes_normalize() -> None:
    def prompts(value: Any) -> Any:
        return CompletionRequest.model_validate({"prompt": value}).prompt

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_repeat_penalty_is_repetition_penalty() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "repeat_penalty": 1.3})
    assert body.repetition_penalty == 1.3
    assert body.request_sampling(max_tokens=None, logprobs=None).repetition_penalty == 1.3


def test_logit_bias_keys_become_token_ids() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "logit_bias": {"42": -100, "7": 2.5}})
    assert body.logit_bias == {42: -100.0, 7: 2.5}


def test_text_parts_join() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    body.check()
    assert body.messages[0].content == "Hello, world"


def test_unknown_fields_are_accepted_and_named() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "user": "u1", "frobnicate": True})
    assert body.degraded_fields() == ["frobnicate"]  # accepted, not silently dropped


def test_fields_we_cannot_honour_are_named() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": tools, "response_format": {"type": "json_object"}, "audio": {}}
    )
    assert body.degraded_fields() == ["audio"]  # tools and response_format are honoured
    plain = ChatCompletionRequest.model_validate({"messages": USER, "response_format": {"type": "text"}})
    assert plain.degraded_fields() == []


def test_forced_tool_call_without_tools_is_refused() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "tool_choice": "required"})
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    assert caught.value.param == "tool_choice"


def test_chat_template_kwargs_cannot_replace_the_conversation() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "chat_template_kwargs": {"messages": []}})
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    assert caught.value.param == "chat_template_kwargs"


def test_top_logprobs_needs_logprobs() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "top_logprobs": 3})
    with pytest.raises(InvalidRequestError) as caught:
        body.check()
    assert caught.value.param == "top_logprobs"


def test_suffix_and_best_of() -> None:
    CompletionRequest.model_validate({"prompt": "x", "suffix": "y"}).check()  # the model decides (FIM tokens)
    with pytest.raises(InvalidRequestError) as caught:
        CompletionRequest.model_validate({"prompt": [1, 2], "suffix": "y"}).check()
    assert caught.value.param == "suffix"
    assert "fill-in-the-middle" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "n": 3, "best_of": 2}).check()
    assert caught.value.param == "best_of"
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 3}).degraded_fields() == ["best_of"]
    assert CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).degraded_fields() == []


def test_fim_mode() -> None:
    for mode in ("psm", "spm"):
        body = CompletionRequest.model_validate({"prompt": "x", "suffix": "y", "fim_mode": mode})
        body.check()
        assert body.degraded_fields() == []  # whether the model honours it is the model's to say
    with pytest.raises(InvalidRequestError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "suffix": "y", "fim_mode": "middle"}).check()
    assert caught.value.param == "fim_mode"
    # without a suffix there is no gap to lay out
    assert CompletionRequest.model_validate({"prompt": "x", "fim_mode": "psm"}).degraded_fields() == [
        "fim_mode"
    ]


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (InvalidRequestError("bad", "n"), 400, "invalid_request_error"),
        (ContextLengthExceededError("long", "messages"), 400, "invalid_request_error"),
        (NotFoundError("nope", "model", "model_not_found"), 404, "invalid_request_error"),
        (APIError("method_not_allowed", "no"), 405, "invalid_request_error"),
        (payload_too_large(10), 413, "invalid_request_error"),
        (APIError("model_loading", "wait"), 503, "server_error"),
        (OverloadedError("busy"), 503, "server_error"),
        (EngineDeadError("dead"), 500, "server_error"),
        (ArgosyError("boom"), 500, "server_error"),
    ],
)
def test_error_table(error: ArgosyError, status: int, error_type: str) -> None:
    assert status_of(error) == status
    body = openai_error_body(error)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type
    assert body["error"]["message"] == error.message


def test_context_length_code() -> None:
    body = openai_error_body(ContextLengthExceededError("long", "messages"))
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "messages"


def test_every_kind_raised_in_argosy_is_in_the_table() -> None:
    for cls in (
        InvalidRequestError,
        ContextLengthExceededError,
        NotFoundError,
        OverloadedError,
        EngineDeadError,
    ):
        assert cls.kind in ERROR_TABLE


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "deep", "parameters": _nested(40)}}]},
            "tools[0]",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "big",
                            "parameters": {"type": "object", "description": "x" * 70_000},
                        },
                    }
                ]
            },
            "tools[0]",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _nested(40)}}},
            "response_format",
        ),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
    ],
)
def test_limits_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    """Bombs: too many tools, a schema too deep (even past Python's recursion limit) or too
    big, too many logit_bias entries or stop strings — each a 400 naming the field."""
    raw = json.dumps({"model": "m", "messages": USER, **fields})
    try:
        body = ChatCompletionRequest.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        error = from_validation_error(exc)
    else:
        with pytest.raises(InvalidRequestError) as caught:
            body.check()
        error = caught.value
    assert error.param == param and status_of(error) == 400


def test_json_nested_past_the_parsers_limit_is_a_400() -> None:
    depth = 5000
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
    raw = '{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
    raw += '"function":{"name":"deep","parameters":' + schema + "}}]}"
    error = chat_error(raw)
    assert status_of(error) == 400 and "could not parse the JSON body" in error.message
