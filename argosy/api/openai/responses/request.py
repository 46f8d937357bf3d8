"""The Responses API request: its model, its checks, and the turn it asks for.

`ResponsesRequest` validates the wire fields (a 400 names the Responses field: `input[2]`,
`text.format.schema`, `tools[0].type`...) and says them in the chat layer's neutral terms
(argosy/chat/messages.py: tools, tool choice, output format), so tool calls, forced calls and
structured output work as they do for chat completions. `build_turn` renders the stored
conversation + the new input through the chat layer and, for a continuation, extends the
previous turn's token ids (conversation.continued_prompt).

`include: ["message.output_text.logprobs"]` is honoured: output_text parts (and their stream
deltas) carry each token's logprobs with `top_logprobs` alternatives (0..20). `top_logprobs`
without that include has no effect, as on OpenAI (which returns no logprobs then), so it is not
named as degraded. The other values OpenAI knows (IncludeEnum) ask for what this server has
none of (tool call results, image urls): accepted, named in x-argosy-degraded as `include`;
`reasoning.encrypted_content` is refused, as is a value OpenAI does not know.

Accepted but not honoured, named in x-argosy-degraded: `include` (but the logprobs),
`truncation: "auto"`, `background`, `max_tool_calls`, `prompt`, `reasoning.summary` (checked
against OpenAI's values, a 400 naming it otherwise; no summary is written), any field this
server does not know; as the model decides,
`reasoning.effort` (a template that does not read it) and what the chat layer reports
(`text.format` when a forced call overrides it, `tools` next to a JSON format). Refused:
`conversation` (use previous_response_id), non-function tools, media parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from argosy.api.openai.common import request_sampling
from argosy.api.openai.responses.store import StoredResponse
from argosy.api.wire import WireModel, named_unknown
from argosy.chat.messages import ChatInput, Message, OutputFormat, ToolChoice, ToolDefinition
from argosy.core.chat_request import PreparedChat, prepare_chat
from argosy.core.constraints import check_chat_options
from argosy.core.conversation import (
    chat_message,
    continued_prompt,
    generated_token_ids,
    history_messages,
    message_images,
)
from argosy.core.service import ModelService
from argosy.errors import InvalidRequestError
from argosy.sampling_params import MAX_LOGPROBS, RequestSampling
from argosy.sessions.events import MessageAppended

_TOOL_CHOICES = ("auto", "none", "required")
_FORMATS = ("text", "json_object", "json_schema")
# The prompt of a continued turn extends: the previous prompt + its output, or the previous
# prompt alone (the template writes the answer otherwise than it was generated).
_CONTINUED_FROM = ("continued", "extended")


# OpenAI's ReasoningEffort values (passed to a template that reads `reasoning_effort`)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# OpenAI's reasoning.summary values (checked, echoed; no summary is written here: degraded)
REASONING_SUMMARIES = ("auto", "concise", "detailed")

# OpenAI's IncludeEnum: the logprobs are honoured, the encrypted reasoning refused, the rest
# (what tools this server does not have would return, input image urls) accepted, degraded.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDE_VALUES = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    INCLUDE_ENCRYPTED_REASONING,
    INCLUDE_LOGPROBS,
)


class ResponsesRequest(WireModel):
    model: str | None = None
    input: Any = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    # Argosy's own (as on chat completions)
    priority: Any = None
    batch_invariant: bool = False
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.0)  # 0: off (as 1.0)
    ignore_eos: bool = False
    include: list[str] | None = None  # the logprobs honoured; see the module docstring
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with the logprobs include
    # accepted, not honoured (degraded_fields)
    truncation: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None
    service_tier: str | None = None
    stream_options: Any = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def check(self) -> None:
        """Refusals that need no model (a 400 naming the Responses field)."""
        if self.input is None:
            raise InvalidRequestError("Missing required parameter: 'input'.", "input")
        if self.conversation is not None:
            raise InvalidRequestError(
                "'conversation' is not supported; continue a stored response with previous_response_id.",
                "conversation",
            )
        form = self.text_format
        if form.get("type") not in _FORMATS:
            raise InvalidRequestError(
                f"text.format.type must be one of {', '.join(_FORMATS)}, got {form.get('type')!r}.",
                "text.format.type",
            )
        if form["type"] == "json_schema" and not isinstance(form.get("schema"), dict):
            raise InvalidRequestError(
                "text.format json_schema needs a 'schema' object.", "text.format.schema"
            )
        if form["type"] == "json_schema" and not isinstance(form.get("name"), str):
            raise InvalidRequestError("text.format json_schema needs a 'name' string.", "text.format.name")
        if self.background and not self.store:
            raise InvalidRequestError(
                "background responses must be stored: 'background': true needs 'store': true.", "background"
            )
        for value in self.include or []:
            if value not in INCLUDE_VALUES:
                raise InvalidRequestError(
                    f"Invalid value in 'include': {value!r}. Supported values are: {', '.join(INCLUDE_VALUES)}.",
                    "include",
                )
        if INCLUDE_ENCRYPTED_REASONING in (self.include or []):
            raise InvalidRequestError(
                "'reasoning.encrypted_content' cannot be included: this server does not encrypt reasoning "
                "(continue a conversation with previous_response_id instead).",
                "include",
            )
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise InvalidRequestError(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}.",
                "reasoning.effort",
            )
        for key in ("summary", "generate_summary"):  # the deprecated spelling takes the same values
            summary = (self.reasoning or {}).get(key)
            if summary is not None and summary not in REASONING_SUMMARIES:
                raise InvalidRequestError(
                    f"reasoning.{key} must be one of {', '.join(REASONING_SUMMARIES)}, got {summary!r}.",
                    f"reasoning.{key}",
                )
        check_chat_options(self.tool_definitions(), self.neutral_tool_choice(), self.output_format())

    @property
    def reasoning_summary(self) -> str | None:
        """The summary asked for (checked: one of REASONING_SUMMARIES), either spelling."""
        reasoning = self.reasoning or {}
        summary = reasoning.get("summary") or reasoning.get("generate_summary")
        return summary if summary in REASONING_SUMMARIES else None

    @property
    def includes_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or [])

    @property
    def text_format(self) -> dict[str, Any]:
        form = (self.text or {}).get("format") or {"type": "text"}
        return form if isinstance(form, dict) else {"type": form}

    def tool_definitions(self) -> list[ToolDefinition]:
        return [
            ToolDefinition(
                name=_tool_name(tool, position),
                description=tool.get("description"),
                parameters=tool.get("parameters"),
                strict=tool.get("strict") is True,
            )
            for position, tool in enumerate(self.tools or [])
        ]

    def neutral_tool_choice(self) -> ToolChoice:
        choice = self.tool_choice
        if choice is None or choice in _TOOL_CHOICES:
            return ToolChoice(choice or "auto")
        if (
            isinstance(choice, dict)
            and choice.get("type", "function") == "function"  # {"name": ...}: the shorthand
            and isinstance(choice.get("name"), str)
        ):
            return ToolChoice("named", choice["name"])
        raise InvalidRequestError(
            "tool_choice must be auto, none, required or {'type': 'function', 'name': ...}.", "tool_choice"
        )

    def output_format(self) -> OutputFormat | None:
        form = self.text_format
        if form["type"] == "text":
            return None
        schema = form.get("schema") if form["type"] == "json_schema" else None
        name = form.get("name") if isinstance(form.get("name"), str) else None
        return OutputFormat(form["type"], schema, name, form.get("strict") is True)

    def chat_input(self, messages: list[Message]) -> ChatInput:
        kwargs: dict[str, Any] = {}
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return ChatInput(
            messages=messages,
            tools=self.tool_definitions(),
            tool_choice=self.neutral_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            output_format=self.output_format(),
            template_kwargs=kwargs,
        )

    def degraded_fields(self) -> list[str]:
        """Fields never honoured; the model-dependent ones come from build_turn."""
        asks = {
            "include": any(value != INCLUDE_LOGPROBS for value in self.include or []),
            "truncation": self.truncation == "auto",
            "max_tool_calls": self.max_tool_calls is not None,
            "prompt": self.prompt is not None,
            "reasoning.summary": self.reasoning_summary is not None,
        }
        return [name for name, is_asked in asks.items() if is_asked] + named_unknown(self.model_extra or {})

    def sampling(self) -> RequestSampling:
        logprobs = (self.top_logprobs or 0) if self.includes_logprobs else None
        return request_sampling(self, max_tokens=self.max_output_tokens, logprobs=logprobs)

    def echo(self, model_id: str, created_at: int) -> dict[str, Any]:
        """The request fields a Response object repeats."""
        return {
            "created_at": created_at,
            "model": model_id,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls if self.parallel_tool_calls is not None else True,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": self.reasoning_summary},
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": self.text_format},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": self.tools or [],
            "top_p": self.top_p,
            "top_logprobs": self.top_logprobs,
            "user": self.user,
            "metadata": self.metadata or {},
            "background": bool(self.background),
        }


def _tool_name(tool: dict[str, Any], position: int) -> str:
    if tool.get("type") != "function":
        raise InvalidRequestError(
            f"tools[{position}]: tools of type {tool.get('type')!r} are not supported (function tools only).",
            f"tools[{position}].type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"Missing required parameter: 'tools[{position}].name'.", f"tools[{position}].name"
        )
    return name


# -- the turn: history + new input -> prompt ----------------------------------------------------


@dataclass(slots=True)
class Turn:
    """One response about to be generated: its prompt (and how the chat layer runs it)."""

    inputs: list[MessageAppended]
    prepared: PreparedChat
    prompt_source: str  # "continued", "extended" (see _CONTINUED_FROM) or "rendered" (afresh)
    degraded: list[str]


async def build_turn(
    core: ModelService, body: ResponsesRequest, inputs: list[MessageAppended], previous: StoredResponse | None
) -> Turn:
    """The conversation so far + the new input, through the chat layer (template, tools,
    constraints); the prompt ids extend the previous turn's when its text allows."""
    history = history_messages(previous.events) if previous is not None else []
    messages = [Message("system", body.instructions)] if body.instructions else []
    messages += [chat_message(m) for m in [*history, *inputs]]
    chat = body.chat_input(messages)
    # the conversation's images, in the order the messages hold them (each message's parts)
    chat.images = [
        image
        for position, m in enumerate([*history, *inputs])
        for image in message_images(m, "previous_response_id" if position < len(history) else "input")
    ]
    prepared = await prepare_chat(core, chat)
    degraded = ["text.format" if field == "response_format" else field for field in prepared.degraded]
    if (body.reasoning or {}).get("effort") is not None and not core.chat_profile().reads("reasoning_effort"):
        degraded.append("reasoning.effort")
    if previous is not None:
        start = int(previous.metadata.get("output_from_seq", 1))
        previous_prompt = list(previous.metadata.get("prompt_ids", []))
        candidates = [previous_prompt + generated_token_ids(previous.events, start - 1), previous_prompt]
        continued = continued_prompt(candidates, prepared.prompt_text, core.decode, core.encode_rendered)
        if continued is not None:
            position, prepared.prompt_ids = continued
            return Turn(inputs, prepared, _CONTINUED_FROM[position], degraded)
    return Turn(inputs, prepared, "rendered", degraded)
