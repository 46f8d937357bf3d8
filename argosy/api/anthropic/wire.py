"""Anthropic Messages wire shapes -> the neutral chat request (argosy/chat/messages.py).

`system` (a string or text blocks) becomes the first message. A message's content is a
string or a list of blocks:
- user: `text` blocks join into one user message; each `tool_result` (its content a string or
  text blocks, `is_error` marked in the text) becomes a tool message answering its
  `tool_use_id`, in block order; `image` / `document` blocks are refused (the served models
  are text-only) with a 400 naming the block (`messages[0].content[1]`);
- assistant: `text` joins into its content, `thinking` into its reasoning, `tool_use` into its
  calls (input as JSON text); `redacted_thinking` is accepted and left out (it is opaque).
`tools` (`name`, `description`, `input_schema`; only custom tools), `tool_choice` (`auto`,
`any` = required, `tool` = named, `none`; `disable_parallel_tool_use`) and
`output_config.format` (`json_schema`, held to the schema as chat's strict json_schema) map
onto ToolDefinition / ToolChoice / OutputFormat. Every malformed field is a 400 naming it.

Tool ids: ours are `call_…` (or a family's own); on the wire they are `toolu_` + ours without
`call_`, and `toolu_` comes off again on the way in (a template that checks an id's shape sees
the id it made).
"""

from __future__ import annotations

import json
import re
from typing import Any

from argosy.chat.images import IMAGE_SENTINEL, ImagePart, image_from_base64, image_from_url
from argosy.chat.messages import (
    ChatInput,
    Message,
    OutputFormat,
    ToolCallRecord,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
)
from argosy.chat.modalities import media_refusal
from argosy.errors import InvalidRequestError

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# block type -> what a client sent, in the words of the refusal
# block type -> (what a client sent, in the words of the refusal; its medium: why it is refused)
MEDIA_BLOCKS: dict[str, tuple[str, str | None]] = {
    "image": ("images", "image"),
    "document": ("documents", "file"),
    "search_result": ("search results", None),
}
_TOOL_CHOICE_MODES: dict[str, ToolChoiceMode] = {"auto": "auto", "any": "required", "none": "none"}
TOOL_ID_PREFIX = "toolu_"
TOOL_ERROR_PREFIX = "Error: "  # a tool_result with is_error: its text, so marked for the model


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}.", param)


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"Missing required parameter: '{param}'.", param)


def wire_tool_id(call_id: str) -> str:
    """Our call id as Anthropic spells one."""
    return TOOL_ID_PREFIX + call_id.removeprefix("call_")


def core_tool_id(tool_id: str) -> str:
    return tool_id.removeprefix(TOOL_ID_PREFIX)


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequestError(f"'{where}' must be an object with a string 'type'.", f"{where}.type")
    return kind


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        if value is None:
            raise _missing(f"{where}.{key}")
        raise _refuse(f"{where}.{key}", f"expected a string, got {type(value).__name__}")
    return value


def _refuse_block(kind: str, where: str) -> InvalidRequestError:
    if kind in MEDIA_BLOCKS:
        what, medium = MEDIA_BLOCKS[kind]
        if medium is not None:
            return InvalidRequestError(media_refusal(what, where, kind, medium), where)
        return InvalidRequestError(f"This model does not accept {what} ('{where}' is {kind!r}).", where)
    return InvalidRequestError(f"'{where}' has unsupported type {kind!r}.", f"{where}.type")


def text_of_blocks(value: Any, where: str) -> str:
    """A string, or text blocks joined (`system`, a tool_result's content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _refuse(where, "expected a string or a list of text blocks")
    texts: list[str] = []
    for position, block in enumerate(value):
        block_where = f"{where}[{position}]"
        kind = _block_type(block, block_where)
        if kind != "text":
            raise _refuse_block(kind, block_where)
        texts.append(_string(block, "text", block_where))
    return "".join(texts)


def _image_block(block: dict[str, Any], where: str) -> ImagePart:
    """An image block's source: base64 data (a `url` source is read only as a data: URL)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _missing(f"{where}.source")
    if source.get("type") == "base64":
        return image_from_base64(source.get("data"), where)
    if source.get("type") == "url":
        return image_from_url(source.get("url"), where)
    raise _refuse(f"{where}.source.type", f"expected 'base64' or 'url', got {source.get('type')!r}")


def _user_messages(content: list[Any], where: str, images: list[ImagePart]) -> list[Message]:
    messages: list[Message] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append(Message(role="user", content="".join(texts)))
            texts.clear()

    for position, block in enumerate(content):
        block_where = f"{where}[{position}]"
        kind = _block_type(block, block_where)
        if kind == "text":
            texts.append(_string(block, "text", block_where))
        elif kind == "image":  # read; the model says whether it reads images (core/vision.py)
            images.append(_image_block(block, block_where))
            texts.append(IMAGE_SENTINEL)
        elif kind == "tool_result":
            flush()
            tool_use_id = _string(block, "tool_use_id", block_where)
            result = block.get("content", "")
            text = "" if result is None else text_of_blocks(result, f"{block_where}.content")
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool | None):
                raise _refuse(f"{block_where}.is_error", "expected a boolean")
            if is_error:
                text = TOOL_ERROR_PREFIX + text
            messages.append(Message(role="tool", content=text, tool_call_id=core_tool_id(tool_use_id)))
        else:
            raise _refuse_block(kind, block_where)
    flush()
    return messages


def _assistant_message(content: list[Any], where: str) -> Message:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallRecord] = []
    for position, block in enumerate(content):
        block_where = f"{where}[{position}]"
        kind = _block_type(block, block_where)
        if kind == "text":
            texts.append(_string(block, "text", block_where))
        elif kind == "thinking":
            reasoning.append(_string(block, "thinking", block_where))
        elif kind == "redacted_thinking":
            continue  # opaque: nothing a local model can read
        elif kind == "tool_use":
            name = _string(block, "name", block_where)
            tool_id = _string(block, "id", block_where)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _refuse(f"{block_where}.input", "expected an object")
            calls.append(
                ToolCallRecord(name, json.dumps(arguments, ensure_ascii=False), core_tool_id(tool_id))
            )
        else:
            raise _refuse_block(kind, block_where)
    return Message(
        role="assistant",
        content="".join(texts),
        reasoning="".join(reasoning) if reasoning else None,
        tool_calls=calls,
    )


def messages_from_wire(
    system: Any, messages: list[tuple[str, Any]], images: list[ImagePart] | None = None
) -> list[Message]:
    """`messages` as (role, content) pairs, after `system`; image blocks read into `images`."""
    images = [] if images is None else images
    result: list[Message] = []
    if system is not None:
        text = text_of_blocks(system, "system")
        if text:
            result.append(Message(role="system", content=text))
    for index, (role, content) in enumerate(messages):
        where = f"messages[{index}].content"
        if isinstance(content, str):
            result.append(Message(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise _refuse(where, "expected a string or a list of content blocks")
        if role == "assistant":
            result.append(_assistant_message(content, where))
        else:
            result.extend(_user_messages(content, where, images))
    return result


def tools_from_wire(tools: Any) -> list[ToolDefinition]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse("tools", "expected a list of tools")
    definitions: list[ToolDefinition] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _refuse(where, "expected an object")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise _refuse(f"{where}.type", f"only custom tools are supported, got {kind!r}")
        name = tool.get("name")
        if name is None:
            raise _missing(f"{where}.name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _refuse(f"{where}.name", "expected 1 to 128 letters, digits, underscores, dots or dashes")
        schema = tool.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise _refuse(f"{where}.input_schema", "expected a JSON schema object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _refuse(f"{where}.description", "expected a string")
        definitions.append(ToolDefinition(name, description, schema, tool.get("strict") is True))
    return definitions


def tool_choice_from_wire(value: Any) -> tuple[ToolChoice, bool]:
    """The choice, and whether calls may be parallel."""
    if value is None:
        return ToolChoice("auto"), True
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise _refuse("tool_choice", 'expected {"type": "auto" | "any" | "tool" | "none"}')
    kind = value["type"]
    disable_parallel = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool | None):
        raise _refuse("tool_choice.disable_parallel_tool_use", "expected a boolean")
    parallel = not disable_parallel
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _missing("tool_choice.name")
        return ToolChoice("named", name), parallel
    return ToolChoice(_TOOL_CHOICE_MODES[kind]), parallel


def output_format_from_wire(value: Any, param: str = "output_config.format") -> OutputFormat | None:
    """`{"type": "json_schema", "schema": {...}}`: the answer held to the schema (strict, as
    Anthropic's structured outputs are)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse(param, "expected an object")
    kind = value.get("type")
    if kind != "json_schema":
        raise _refuse(f"{param}.type", f"expected 'json_schema', got {kind!r}")
    schema = value.get("schema")
    if schema is None:
        raise _missing(f"{param}.schema")
    if not isinstance(schema, dict):
        raise _refuse(f"{param}.schema", "expected a JSON schema object")
    return OutputFormat("json_schema", schema, None, strict=True)


def chat_input_from_wire(
    system: Any,
    messages: list[tuple[str, Any]],
    *,
    tools: Any = None,
    tool_choice: Any = None,
    output_format: Any = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatInput:
    choice, parallel = tool_choice_from_wire(tool_choice)
    images: list[ImagePart] = []
    return ChatInput(
        messages=messages_from_wire(system, messages, images),
        images=images,
        tools=tools_from_wire(tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        output_format=output_format_from_wire(output_format),
        template_kwargs=dict(template_kwargs or {}),
    )
