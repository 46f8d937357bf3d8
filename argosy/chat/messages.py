"""A chat request in neutral terms: messages, tools, tool choice and output format.

Every dialect (OpenAI chat and responses, later Anthropic and Ollama) translates its wire
shapes into these; argosy/core/chat_request.py turns a ChatInput into what the core runs.
A conversation may end with a partial assistant turn to be *continued*
(`continue_final_message`): the prompt is that turn left open, and the output carries on its
text (see ChatTemplate.render). `check_continuation` holds the rules every dialect shares.
`template_messages` writes messages the way chat templates read them (transformers'
convention): an assistant's calls as `tool_calls: [{id, type, function: {name, arguments}}]`
with the arguments as a dict (the wire carries JSON text; templates mostly `tojson` them), its
reasoning as `reasoning_content`, a tool result's `tool_call_id`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from argosy.chat.images import ImagePart
from argosy.errors import InvalidRequestError

ToolChoiceMode = Literal["auto", "none", "required", "named"]
OutputFormatKind = Literal["text", "json_object", "json_schema"]


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    """A call an assistant made earlier in the conversation."""

    name: str
    arguments: str  # JSON text, as the wire carries it
    call_id: str | None = None

    def arguments_value(self) -> Any:
        """The arguments as templates want them: the decoded object, else the text as is."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments


@dataclass(slots=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool" (dialects map their own roles)
    content: str | None = None
    name: str | None = None
    reasoning: str | None = None  # an assistant turn's reasoning, handed back
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    tool_call_id: str | None = None  # a tool result: the call it answers


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; None: any object
    strict: bool = False

    def template_json(self) -> dict[str, Any]:
        """The tool as chat templates (and our own tool prompt) list it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    name: str | None = None  # the tool to call, for mode "named"

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What the answer's text must be: free text, any JSON object, or JSON of `schema`."""

    kind: OutputFormatKind = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(slots=True)
class ChatInput:
    """One chat request, dialect-free: what to render and how to constrain and parse the output."""

    messages: list[Message]
    tools: list[ToolDefinition] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # enable_thinking, reasoning_effort...
    # The prompt ends with the template's generation prompt (a new assistant turn opened) ...
    add_generation_prompt: bool = True
    # ... or with the final (assistant) message left open, its text continued by the output.
    continue_final_message: bool = False
    # At most this many tokens of reasoning, then its end marker is forced (a reasoning model).
    reasoning_budget: int | None = None
    # Calls failing their tool's schema written again under its grammar, at most this many per
    # request (0: none, sent back as text); None: the server's --tool-repair-budget.
    tool_repair_budget: int | None = None
    # images in the messages' parts (chat/images.py), in order; each one's place in its
    # message's text is IMAGE_SENTINEL
    images: list[ImagePart] = field(default_factory=list)


def check_continuation(chat: ChatInput) -> None:
    """A 400 unless a continued final message can be: the final message is an assistant's,
    without tool calls (the text to continue is its content), and no generation prompt follows."""
    if not chat.continue_final_message:
        return
    if chat.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true: a continued "
            "final message opens no new turn.",
            "continue_final_message",
        )
    final = chat.messages[-1] if chat.messages else None
    if final is None or final.role != "assistant":
        role = "no message" if final is None else f"a {final.role!r} message"
        raise InvalidRequestError(
            f"continue_final_message needs the conversation to end with an assistant message, "
            f"it ends with {role}.",
            "continue_final_message",
        )
    if final.tool_calls:
        raise InvalidRequestError(
            "continue_final_message cannot continue an assistant message that made tool calls.",
            "messages",
        )


def template_message(message: Message) -> dict[str, Any]:
    """One message as chat templates read it (keys with no value are left out)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.role == "assistant":
        if message.reasoning is not None:
            rendered["reasoning_content"] = message.reasoning
        if message.tool_calls:
            rendered["tool_calls"] = [
                {
                    **({"id": call.call_id} if call.call_id is not None else {}),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_value()},
                }
                for call in message.tool_calls
            ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    return [template_message(message) for message in messages]
