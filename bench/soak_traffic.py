"""The soak's traffic (bench/soak.py): the scenario mix, each request's checks, and how an
outcome is classified (ok, deliberate 4xx, 503, or an error class)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
from workloads import TOPICS

CLASSES = ("ok", "deliberate_4xx", "503", "unexpected_4xx", "5xx", "transport", "timeout", "bad_response")
EXPECTED_CLASSES = frozenset({"ok", "deliberate_4xx", "503"})
CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Accra", "Hanoi")
# bounded strings: a call is a few dozen tokens whatever is sampled, so max_tokens 64 holds it
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOL_SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in TOOL_SCHEMAS.items()
]
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
BAD_BODIES: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 8},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
)
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Outcome:
    scenario: str
    cls: str
    latency_s: float
    finished_at: float  # time.monotonic()
    detail: str = ""


class Failure(Exception):
    """A call that did not end ok: `cls` is one of CLASSES."""

    def __init__(self, cls: str, detail: str, retry_after_s: float = 0.0) -> None:
        super().__init__(detail)
        self.cls = cls
        self.detail = detail
        self.retry_after_s = retry_after_s


def check_status(response: httpx.Response, expect_400: bool = False) -> None:
    """Raises Failure unless the status is what the call expects (200, or 400 when deliberate)."""
    status = response.status_code
    if expect_400 and status == 400:
        raise Failure("deliberate_4xx", "400")
    if status == 200:
        if expect_400:
            raise Failure("bad_response", "invalid request accepted with 200")
        return
    if not response.is_stream_consumed:
        response.read()
    detail = f"{status} {response.text[:160]}"
    if status == 503 and "retry-after" in response.headers:
        try:
            retry_after = float(response.headers["retry-after"])
        except ValueError:
            retry_after = 1.0  # an HTTP date: back off a second
        raise Failure("503", detail, retry_after_s=retry_after)
    raise Failure("unexpected_4xx" if 400 <= status < 500 else "5xx", detail)


def require(condition: bool, detail: str) -> None:
    if not condition:
        raise Failure("bad_response", detail)


def post_json(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    check_status(response)
    try:
        payload: dict[str, Any] = response.json()
    except ValueError as error:
        raise Failure("bad_response", f"body is not JSON: {error}") from error
    return payload


def sse_chunks(response: httpx.Response, started: float, timeout_s: float) -> Iterator[dict[str, Any]]:
    """The data frames of a chat stream; Failure on an error event, a bad frame, no [DONE]."""
    is_error_event = False
    for line in response.iter_lines():
        if time.monotonic() - started > timeout_s:
            raise Failure("timeout", f"stream still open after {timeout_s:.0f}s")
        if line.startswith("event: error"):
            is_error_event = True
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if is_error_event:
            raise Failure("5xx", f"error event in stream: {data[:160]}")
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError as error:
            raise Failure("bad_response", f"stream frame is not JSON: {data[:80]}") from error
    raise Failure("bad_response", "stream ended without [DONE]")


def check_choice(choice: dict[str, Any]) -> None:
    finish = choice.get("finish_reason")
    require(finish in ("stop", "length", "tool_calls"), f"finish_reason {finish!r}")
    require(isinstance(choice.get("message", {}).get("content"), str), "message.content is not a string")


class Scenarios:
    """Each scenario makes one or more calls through `call`, which times and records each."""

    def __init__(self, model: str, rng: random.Random, timeout_s: float) -> None:
        self.model = model
        self.rng = rng
        self.timeout_s = timeout_s

    def prompt(self) -> str:
        return f"Write a short paragraph about {self.rng.choice(TOPICS)}."

    def chat_body(self, **fields: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.rng.choice((16, 32, 48)),
            "temperature": 0.7,
            "seed": self.rng.randrange(1 << 30),
        }
        return {**body, **fields}

    def chat(self, http: httpx.Client) -> None:
        body = post_json(http, CHAT, self.chat_body())
        require(len(body.get("choices", [])) == 1, "not one choice")
        check_choice(body["choices"][0])
        require(body.get("usage", {}).get("completion_tokens", 0) > 0, "no completion tokens in usage")

    def chat_stream(self, http: httpx.Client) -> None:
        started = time.monotonic()
        body = self.chat_body(stream=True, stream_options={"include_usage": True})
        finish, has_usage = None, False
        with http.stream("POST", CHAT, json=body) as response:
            check_status(response)
            for chunk in sse_chunks(response, started, self.timeout_s):
                has_usage = has_usage or bool(chunk.get("usage"))
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        require(finish in ("stop", "length"), f"stream finish_reason {finish!r}")
        require(has_usage, "stream without a usage chunk")

    def tools(self, http: httpx.Client) -> None:
        question = f"What is the weather in {self.rng.choice(CITIES)}?"
        body = self.chat_body(
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
        )
        choice = post_json(http, CHAT, body)["choices"][0]
        finish, calls = choice.get("finish_reason"), choice["message"].get("tool_calls") or []
        require(finish in ("tool_calls", "length"), f"tool_choice required ended with {finish!r}")
        if finish == "length":
            return  # cut by max_tokens: nothing to hold the call to
        require(len(calls) >= 1, "finish_reason tool_calls without a tool call")
        for call in calls:
            name = call.get("function", {}).get("name")
            require(name in TOOL_SCHEMAS, f"unknown tool {name!r}")
            try:
                jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as error:
                raise Failure("bad_response", f"{name} arguments: {str(error)[:120]}") from error

    def json_schema(self, http: httpx.Client) -> None:
        question = f"Invent a person who works with {self.rng.choice(TOPICS)}. Answer in JSON."
        schema = {"name": "person", "schema": PERSON_SCHEMA, "strict": True}
        body = self.chat_body(
            messages=[{"role": "user", "content": question}],
            response_format={"type": "json_schema", "json_schema": schema},
            max_tokens=48,
        )
        choice = post_json(http, CHAT, body)["choices"][0]
        check_choice(choice)
        if choice["finish_reason"] != "stop":
            return
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON_SCHEMA)
        except (ValueError, jsonschema.ValidationError) as error:
            text = choice["message"]["content"][:80]
            raise Failure("bad_response", f"json_schema output {text!r}: {str(error)[:80]}") from error

    def n2(self, http: httpx.Client) -> None:
        body = post_json(http, CHAT, self.chat_body(n=2))
        choices = body.get("choices", [])
        require(sorted(c.get("index") for c in choices) == [0, 1], f"n=2 gave indexes {len(choices)}")
        for choice in choices:
            check_choice(choice)

    def completions(self, http: httpx.Client) -> None:
        body = {
            "model": self.model,
            "prompt": f"The {self.rng.choice(TOPICS)} is",
            "max_tokens": 16,
            "temperature": 0.7,
            "seed": self.rng.randrange(1 << 30),
        }
        choices = post_json(http, "/v1/completions", body).get("choices", [])
        require(len(choices) == 1 and isinstance(choices[0].get("text"), str), "no completion text")
        require(choices[0].get("finish_reason") in ("stop", "length"), "completion finish_reason")

    def response_turn(self, http: httpx.Client, text: str, previous: str | None) -> str:
        body = {"model": self.model, "input": text, "max_output_tokens": 24, "temperature": 0.7}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = post_json(http, "/v1/responses", body)
        require(answer.get("status") in ("completed", "incomplete"), f"status {answer.get('status')!r}")
        require(answer.get("previous_response_id") == previous, "previous_response_id not echoed")
        types = [item.get("type") for item in answer.get("output", [])]
        require("message" in types, f"output items {types}")
        require(isinstance(answer.get("id"), str), "no response id")
        return str(answer["id"])

    def cancel(self, http: httpx.Client) -> None:
        started = time.monotonic()
        body = self.chat_body(stream=True, max_tokens=64, ignore_eos=True)
        wanted = self.rng.randint(1, 4)
        with http.stream("POST", CHAT, json=body) as response:
            check_status(response)
            for index, _ in enumerate(sse_chunks(response, started, self.timeout_s)):
                if index + 1 >= wanted:
                    break  # leaving the block closes the connection mid-stream

    def tools_auto(self, http: httpx.Client) -> None:
        """tool_choice auto: the model may call or answer; a call it makes must be well-formed."""
        question = self.rng.choice((f"What is the weather in {self.rng.choice(CITIES)}?", self.prompt()))
        body = self.chat_body(messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=64)
        choice = post_json(http, CHAT, body)["choices"][0]
        check_choice(choice)
        for call in choice["message"].get("tool_calls") or []:
            name = call.get("function", {}).get("name")
            require(name in TOOL_SCHEMAS, f"auto: unknown tool {name!r}")
            try:
                jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as error:
                raise Failure("bad_response", f"auto {name} arguments: {str(error)[:120]}") from error

    def anthropic(self, http: httpx.Client) -> None:
        body = {
            "model": self.model,
            "max_tokens": self.rng.choice((16, 32)),
            "messages": [{"role": "user", "content": self.prompt()}],
            "temperature": 0.7,
        }
        answer = post_json(http, "/v1/messages", body)
        require(answer.get("type") == "message", f"anthropic type {answer.get('type')!r}")
        require(
            answer.get("stop_reason") in ("end_turn", "max_tokens"),
            f"stop_reason {answer.get('stop_reason')!r}",
        )
        require(answer.get("usage", {}).get("output_tokens", 0) > 0, "anthropic usage without output tokens")

    def ollama_chat(self, http: httpx.Client) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt()}],
            "stream": self.rng.random() < 0.5,
            "options": {"num_predict": 24, "temperature": 0.7, "seed": self.rng.randrange(1 << 30)},
        }
        with http.stream("POST", "/api/chat", json=body) as response:
            check_status(response)
            lines = [json.loads(line) for line in response.iter_lines() if line.strip()]
        require(bool(lines) and lines[-1].get("done") is True, "ollama stream without a done line")
        require(not any("error" in line for line in lines), "an error line in an ollama stream")
        require(lines[-1].get("eval_count", 0) > 0, "ollama done line without eval_count")

    def bad(self, http: httpx.Client) -> None:
        body = {"model": self.model, **self.rng.choice(BAD_BODIES)}
        check_status(http.post(CHAT, json=body), expect_400=True)


MIX: tuple[tuple[str, int], ...] = (
    ("chat", 2),
    ("chat_stream", 2),
    ("tools", 1),
    ("tools_auto", 1),
    ("anthropic", 1),
    ("ollama_chat", 1),
    ("json_schema", 1),
    ("n2", 1),
    ("completions", 1),
    ("responses", 1),
    ("cancel", 1),
    ("bad", 1),
)


def turn_text(rng: random.Random, turn: int) -> str:
    if turn == 0:
        return f"Let us talk about {rng.choice(TOPICS)}. What is it?"
    return rng.choice(("Tell me more.", "Why does that matter?", "Summarise that in one line."))
