"""Ollama's wire pieces: keep_alive durations, the Go-template subset, options named as
degraded, tool_choice, tool calls rendered, and the error envelope."""

from __future__ import annotations

import math

import pytest

from argosy.api.errors import ollama_error_body, ollama_status_of
from argosy.api.ollama.template import render_ollama_template
from argosy.api.ollama.wire import (
    Options,
    core_model_name,
    parse_keep_alive,
    tool_call_json,
    tool_choice_of,
    wire_model_name,
)
from argosy.chat.messages import ToolChoice, ToolDefinition
from argosy.errors import InvalidRequestError, ModelNotFoundError, OverloadedError


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (300, 300.0),
        (-1, -1.0),
        (2.5, 2.5),
        ("0", 0.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("-1s", -1.0),
        ("250ms", 0.25),
        ("10s", 10.0),
    ],
)
def test_keep_alive_durations(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", "", "1x", True, [1], math.inf])
def test_keep_alive_refusals_name_the_field(value: object) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_keep_alive(value)
    assert refused.value.param == "keep_alive"


def test_model_names() -> None:
    assert core_model_name("smollm2:latest") == "smollm2"
    assert core_model_name("smollm2:135m") == "smollm2:135m"
    assert wire_model_name("smollm2") == "smollm2:latest"
    assert wire_model_name("qwen3:0.6b") == "qwen3:0.6b"


def test_go_template_subset() -> None:
    template = "{{- if .System }}<s>{{ .System }}</s>\n{{ end -}}\nQ: {{ .Prompt }}\nA:{{ .Response }}<end>"
    assert (
        render_ollama_template(template, system="Be brief.", prompt="2+2?") == "<s>Be brief.</s>\nQ: 2+2?\nA:"
    )
    assert render_ollama_template(template, system=None, prompt="2+2?") == "Q: 2+2?\nA:"
    with_else = "{{ if .System }}{{ .System }}{{ else }}default{{ end }}: {{ .Prompt }}"
    assert render_ollama_template(with_else, system=None, prompt="x") == "default: x"
    assert render_ollama_template("{{/* a comment */}}{{ .Prompt }}", system=None, prompt="y") == "y"


@pytest.mark.parametrize(
    "template",
    [
        "{{ range .Messages }}{{ .Content }}{{ end }}",
        "{{ if .Tools }}x{{ end }}",
        "{{ .Prompt }",
        "{{ if .System }}open",
        "{{ end }}",
        "{{ else }}",
        "{{ json .Prompt }}",
    ],
)
def test_go_template_refusals_name_the_template(template: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        render_ollama_template(template, system=None, prompt="p")
    assert refused.value.param == "template"


def test_options_degraded_names() -> None:
    options = Options.model_validate(
        {"num_thread": 4, "mirostat": 0, "num_ctx": 4096, "repeat_last_n": 64, "colour": 1, "temperature": 0}
    )
    assert options.degraded(1024) == [
        "options.num_thread",
        "options.mirostat",
        "options.num_ctx",
        "options.repeat_last_n",
        "options.colour",
    ]
    assert Options.model_validate({"num_ctx": 1024, "repeat_last_n": -1}).degraded(1024) == []
    assert Options.model_validate({"num_predict": -1}).max_tokens() is None
    assert Options.model_validate({"num_predict": -2}).max_tokens() is None
    assert Options.model_validate({"num_predict": 7}).max_tokens() == 7
    with pytest.raises(InvalidRequestError):
        Options.model_validate({"num_predict": 0}).check()


def test_tool_choice_extension() -> None:
    tools = [ToolDefinition("get_weather")]
    assert tool_choice_of(None, tools) == ToolChoice()
    assert tool_choice_of("required", tools) == ToolChoice("required")
    named = tool_choice_of({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert named == ToolChoice("named", "get_weather")
    with pytest.raises(InvalidRequestError) as unknown:
        tool_choice_of({"type": "function", "function": {"name": "nope"}}, tools)
    assert unknown.value.param == "tool_choice.function.name"
    with pytest.raises(InvalidRequestError):
        tool_choice_of("always", tools)


def test_tool_call_json() -> None:
    assert tool_call_json("call_1", 0, "f", '{"a": 1}') == {
        "id": "call_1",
        "function": {"index": 0, "name": "f", "arguments": {"a": 1}},
    }
    assert tool_call_json("call_2", 1, "f", "")["function"]["arguments"] == {}  # type: ignore[index]
    assert tool_call_json("call_3", 0, "f", "[1, 2]") is None  # not an object: left as text
    assert tool_call_json("call_4", 0, "f", "{broken") is None


def test_error_envelope_and_statuses() -> None:
    missing = ModelNotFoundError("llama3", ["smollm2", "minilm"])
    assert ollama_status_of(missing) == 404
    assert ollama_error_body(missing)["error"].startswith('model "llama3" not found')
    assert ollama_error_body(InvalidRequestError("bad")) == {"error": "bad"}
    assert ollama_status_of(InvalidRequestError("bad")) == 400
    assert ollama_status_of(OverloadedError("busy")) == 503
