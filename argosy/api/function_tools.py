"""Function tools in the wire shape OpenAI chat defined and Ollama adopted: `tools`
(`[{type: "function", function: {name, description, parameters, strict}}]`), `tool_choice`
("auto", "none", "required", `{type: "function", function: {name}}`) and an assistant
message's `tool_calls` (`{id, type, function: {name, arguments}}`, arguments as JSON text or
as the object itself) -> the neutral ToolDefinition / ToolChoice / ToolCallRecord. A
malformed one is a 400 whose `param` names the exact field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from argosy.chat.messages import ToolCallRecord, ToolChoice, ToolDefinition
from argosy.errors import InvalidRequestError

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}.", param)


def _optional_str(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _refuse(param, f"expected a string, got {type(value).__name__}")


def call_from_wire(call: Any, where: str) -> ToolCallRecord:
    if not isinstance(call, dict):
        raise _refuse(where, "expected an object")
    if call.get("type", "function") != "function":
        raise _refuse(f"{where}.type", f"expected 'function', got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"Missing required parameter: '{where}.function'.", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _refuse(f"{where}.function.name", "expected a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise _refuse(f"{where}.function.arguments", "expected a JSON string")
    return ToolCallRecord(name, arguments, _optional_str(call.get("id"), f"{where}.id"))


def tools_from_wire(tools: Any, max_name_chars: int = 64) -> list[ToolDefinition]:
    """`[{type: "function", function: {name, description, parameters, strict}}]` (OpenAI
    allows names of 64 characters; Ollama 128)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse("tools", "expected a list of tools")
    definitions: list[ToolDefinition] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _refuse(where, "expected an object")
        if tool.get("type", "function") != "function":
            raise _refuse(f"{where}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"Missing required parameter: '{where}.function'.", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name) or len(name) > max_name_chars:
            raise _refuse(
                f"{where}.function.name",
                f"expected 1 to {max_name_chars} letters, digits, underscores, dots or dashes",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _refuse(f"{where}.function.parameters", "expected a JSON schema object")
        strict = function.get("strict") is True
        description = _optional_str(function.get("description"), f"{where}.function.description")
        definitions.append(ToolDefinition(name, description, parameters, strict))
    return definitions


def tool_choice_from_wire(value: Any) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value in ("none", "required"):
        return ToolChoice(value)
    # OpenAI's {"type": "function", "function": {"name": ...}}; also the shorthands
    # {"name": ...} and {"type": "function", "name": ...} (the Responses API's), as the reference took
    if isinstance(value, dict) and value.get("type", "function") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("named", name)
    raise _refuse(
        "tool_choice",
        'expected "auto", "none", "required", {"type": "function", "function": {"name": ...}} '
        'or {"name": ...}',
    )
