"""OpenAI chat wire shapes -> the neutral chat request (argosy/chat/messages.py).

Messages' `tool_calls`, `tool_call_id` and `reasoning_content` / `reasoning`, and the request's
`tools`, `tool_choice`, `parallel_tool_calls` and `response_format`, checked here with no
model at hand; a malformed one is a 400 whose `param` names the exact field
(`messages[1].tool_calls[0].function.arguments`, `tools[0].function.name`, `tool_choice`,
`response_format`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from argosy.api.function_tools import call_from_wire, tool_choice_from_wire, tools_from_wire
from argosy.chat.messages import (
    ChatInput,
    Message,
    OutputFormat,
)
from argosy.errors import InvalidRequestError

_ROLES = {"developer": "system"}


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}.", param)


def _optional_str(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _refuse(param, f"expected a string, got {type(value).__name__}")


def message_from_wire(
    index: int, role: str, content: str | None, name: str | None, extra: Mapping[str, Any]
) -> Message:
    """One message; `extra` holds the fields beyond role / content / name."""
    where = f"messages[{index}]"
    message = Message(role=_ROLES.get(role, role), content=content, name=name)
    if role == "assistant":
        reasoning = extra.get("reasoning_content", extra.get("reasoning"))
        field_name = "reasoning_content" if "reasoning_content" in extra else "reasoning"
        message.reasoning = _optional_str(reasoning, f"{where}.{field_name}")
        calls = extra.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _refuse(f"{where}.tool_calls", "expected a list of tool calls")
            message.tool_calls = [
                call_from_wire(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)
            ]
    if role == "tool":
        call_id = _optional_str(extra.get("tool_call_id"), f"{where}.tool_call_id")
        if call_id is None:
            raise InvalidRequestError(
                f"Missing required parameter: '{where}.tool_call_id'.", f"{where}.tool_call_id"
            )
        message.tool_call_id = call_id
    return message


# the keys of OpenAI's json_schema object that are not the schema itself
_JSON_SCHEMA_WRAPPER = frozenset({"name", "description", "strict"})


def _inline_schema(spec: dict[str, Any]) -> dict[str, Any] | None:
    """A json_schema object with no inner `schema` that carries the schema inline
    (`{"type": "object", "properties": ...}`, as the reference reads it): the schema is the
    object less OpenAI's wrapper keys; None when nothing else is there."""
    schema = {key: value for key, value in spec.items() if key not in _JSON_SCHEMA_WRAPPER}
    return schema or None


def output_format_from_wire(value: Any) -> OutputFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse("response_format", "expected an object")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return OutputFormat(kind)
    if kind != "json_schema":
        raise _refuse(
            "response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            "response_format of type json_schema needs a json_schema object with a schema.", "response_format"
        )
    schema = spec.get("schema") if "schema" in spec else _inline_schema(spec)
    if schema is not None and not isinstance(schema, dict):
        raise _refuse("response_format.json_schema.schema", "expected a JSON schema object")
    name = _optional_str(spec.get("name"), "response_format.json_schema.name")
    return OutputFormat("json_schema", schema, name, spec.get("strict") is True)


def chat_input_from_wire(
    messages: Sequence[tuple[str, str | None, str | None, Mapping[str, Any]]],
    *,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    response_format: Any = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatInput:
    """`messages` as (role, content, name, extra fields) each."""
    return ChatInput(
        messages=[message_from_wire(i, *message) for i, message in enumerate(messages)],
        tools=tools_from_wire(tools),
        tool_choice=tool_choice_from_wire(tool_choice),
        parallel_tool_calls=parallel_tool_calls is not False,
        output_format=output_format_from_wire(response_format),
        template_kwargs=dict(template_kwargs or {}),
    )
