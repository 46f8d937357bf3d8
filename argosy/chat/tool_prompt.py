"""Our own ChatML / Hermes tool prompt, for models whose chat template knows no tools.

A template that never reads `tools` (SmolLM2's) would silently drop them. For such a model
the conversation is rewritten before its template renders it, the way Qwen2.5's template
writes tools and calls:

- the tools go into the system prompt (appended to the first system message, or as a system
  message of their own), listed as JSON in `<tools></tools>`, with the instruction to answer
  a call as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
- an assistant turn's earlier calls become those blocks after its text;
- tool results become a user turn of `<tool_response>\\n...\\n</tool_response>` blocks (a run
  of tool messages, one turn).

The output is then parsed with the Hermes call syntax (argosy/chat/families/hermes.py).
"""

from __future__ import annotations

import json
from typing import Any

from argosy.chat.messages import Message, ToolCallRecord, ToolDefinition, template_message

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_section(tools: list[ToolDefinition]) -> str:
    """The system-prompt section that lists the tools and says how to call them."""
    listed = "".join("\n" + json.dumps(tool.template_json(), ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + listed + TOOLS_FOOTER


def call_block(call: ToolCallRecord) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments_value()}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_conversation(messages: list[Message], tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """`messages` rewritten for a template without tool support (see the module docstring);
    `tools` empty: no tools section (tool_choice "none"), history still rewritten."""
    rendered: list[dict[str, Any]] = []
    if tools:
        section = tools_section(tools)
        first = messages[0] if messages else None
        if first is not None and first.role == "system":
            system = template_message(first)
            system["content"] = f"{first.content}\n\n{section}" if first.content else section
            rendered.append(system)
            messages = messages[1:]
        else:
            rendered.append({"role": "system", "content": section})
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content or ''}\n</tool_response>"
            previous = rendered[-1] if rendered else None
            if previous is not None and previous.get("is_tool_responses"):
                previous["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "is_tool_responses": True})
            continue
        entry = template_message(message)
        if message.role == "assistant" and message.tool_calls:
            entry.pop("tool_calls")
            blocks = [call_block(call) for call in message.tool_calls]
            entry["content"] = "\n".join([message.content, *blocks] if message.content else blocks)
        rendered.append(entry)
    for entry in rendered:
        entry.pop("is_tool_responses", None)
    return rendered
