"""tools / tool_choice / parallel_tool_calls / response_format -> grammar and parser options.

Dialect-free: it reads the neutral ToolDefinition / ToolChoice / OutputFormat
(argosy/chat/messages.py), so every dialect gets the same rules and the same errors.

- `auto`: the tools go into the prompt; calls in the output are parsed, nothing is forced.
- `none`: no tools in the prompt and no call parsing (call-looking text stays content).
- `required`: a grammar forces one call (or several, with parallel_tool_calls) of any
  declared tool, each call's arguments valid for that tool's schema.
- named: a grammar forces exactly one call of that tool.
- `parallel_tool_calls: false`: a forced grammar allows exactly one call; the parser keeps
  the first call and reports later ones (ToolParseFailure "extra_call").
- response_format `json_object` / `json_schema` constrains the answer; `strict` is honoured
  (False: JSON Schema's defaults, properties beyond the schema allowed).

A forced call and a response_format cannot both constrain the output: the call wins and
`response_format` is named as degraded; tools offered with `auto` next to a response_format
cannot be called (the answer must be the JSON) and `tools` is named as degraded.
Refusals (HTTP 400, `param` naming the field): a named tool that is not declared, a forced
call with no tools, json_schema without a schema, duplicate tool names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from argosy.chat.families import CallSyntax
from argosy.chat.messages import ChatInput, OutputFormat, ToolChoice, ToolDefinition
from argosy.chat.parser_options import ParserOptions
from argosy.errors import InvalidRequestError
from argosy.runner.structured import GrammarSpec, GuideSpec, ToolCallGrammar, ToolSchema


@dataclass(slots=True)
class ChatConstraints:
    """What a chat request's options ask of the prompt, the decoder and the parser."""

    prompt_tools: list[ToolDefinition]  # the tools rendered into the prompt
    parser_options: ParserOptions
    grammar: GrammarSpec | None = None
    grammar_param: str | None = None  # the request field a grammar error names
    degraded: list[str] = field(default_factory=list)


# Bounds on what a request may ask the grammar compiler and the prompt to carry: past them a
# 400 names the field (a huge or deeply nested schema would otherwise cost seconds of compile
# time or a recursion error, and a thousand tools would not fit any context anyway).
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024  # one schema, as compact JSON
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays


def check_schema_size(schema: Any, param: str) -> None:
    """A 400 naming `param` for a schema past MAX_SCHEMA_BYTES or MAX_SCHEMA_DEPTH."""
    if schema is None:
        return
    depth = _depth(schema, 0)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(
            f"The schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed.", param
        )
    try:
        size = len(json.dumps(schema, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"The schema is not JSON: {exc}.", param) from exc
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"The schema is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are allowed.", param
        )


def _depth(value: Any, level: int) -> int:
    if level > MAX_SCHEMA_DEPTH:  # deep enough to refuse; stop before the recursion limit
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def check_chat_options(
    tools: list[ToolDefinition], tool_choice: ToolChoice, output_format: OutputFormat | None
) -> None:
    """The refusals that need no model (run before a model is resolved)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"At most {MAX_TOOLS} tools are allowed, got {len(tools)}.", "tools")
    for position, tool in enumerate(tools):
        check_schema_size(tool.parameters, f"tools[{position}]")
    if output_format is not None:
        check_schema_size(output_format.schema, "response_format")
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InvalidRequestError(f"Tool names must be unique; repeated: {', '.join(duplicates)}.", "tools")
    if tool_choice.is_forced and not tools:
        raise InvalidRequestError("tool_choice forces a tool call, but no tools were given.", "tool_choice")
    if tool_choice.mode == "named" and tool_choice.name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {tool_choice.name!r}, which is not among the declared "
            f"tools ({', '.join(names)}).",
            "tool_choice",
        )
    if output_format is not None and output_format.kind == "json_schema" and output_format.schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs a schema (json_schema.schema).", "response_format"
        )


def plan_constraints(chat: ChatInput, call_syntax: CallSyntax) -> ChatConstraints:
    """The grammar (if any), the parser options and the prompt's tools for `chat`, for a
    model whose calls take `call_syntax`."""
    check_chat_options(chat.tools, chat.tool_choice, chat.output_format)
    choice = chat.tool_choice
    uses_tools = bool(chat.tools) and choice.mode != "none"
    parallel = chat.parallel_tool_calls and choice.mode != "named"
    constraints = ChatConstraints(
        prompt_tools=list(chat.tools) if uses_tools else [],
        parser_options=ParserOptions(
            has_tool_calls=uses_tools,
            tool_names=frozenset(tool.name for tool in chat.tools),
            can_call_in_parallel=parallel,
            is_call_forced=choice.is_forced,
        ),
    )
    wants_json = chat.output_format is not None and chat.output_format.kind != "text"
    if choice.is_forced:
        chosen = [tool for tool in chat.tools if choice.mode == "required" or tool.name == choice.name]
        constraints.grammar = GrammarSpec("tool_call", forced_call_grammar(chosen, call_syntax, parallel))
        constraints.grammar_param = "tools"
        if wants_json:
            constraints.degraded.append("response_format")
    elif wants_json:
        assert chat.output_format is not None
        constraints.grammar = output_grammar(chat.output_format)
        constraints.grammar_param = "response_format"
        if uses_tools:
            constraints.degraded.append("tools")
    return constraints


def forced_call_grammar(tools: list[ToolDefinition], syntax: CallSyntax, parallel: bool) -> ToolCallGrammar:
    """Calls in the family's own shape: `<tool_call>\\n{...}\\n</tool_call>` blocks where the
    family writes them so, else bare call objects one per line (the parser's forced mode
    reads both)."""
    schemas = [ToolSchema(tool.name, tool.parameters) for tool in tools]
    if syntax.open_marker and syntax.close_marker:
        return ToolCallGrammar(
            schemas,
            parallel=parallel,
            begin=syntax.open_marker + "\n",
            end="\n" + syntax.close_marker,
            arguments_key=syntax.args_key,
        )
    return ToolCallGrammar(
        schemas, parallel=parallel, begin="", end="", separator="\n", arguments_key=syntax.args_key
    )


def output_grammar(output_format: OutputFormat) -> GrammarSpec:
    if output_format.kind == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec("json_schema", output_format.schema, strict=output_format.strict)


def guide_spec(
    grammar: GrammarSpec,
    *,
    start_ids: list[int],
    end_ids: list[int],
    is_reasoning_open: bool,
    may_reason: bool,
) -> GuideSpec:
    """A guide that leaves a thinking model's reasoning free and constrains what follows it.

    The prompt opened the reasoning block: the grammar starts after the end marker. The model
    may open one itself (a one-token start marker, thinking not switched off): the first token
    is that marker or the grammar's. Otherwise the grammar holds from the first token.
    """
    if is_reasoning_open and end_ids:
        return GuideSpec(grammar, "delayed", end_token_ids=tuple(end_ids))
    if may_reason and len(start_ids) == 1 and end_ids:
        return GuideSpec(grammar, "optional", start_token_id=start_ids[0], end_token_ids=tuple(end_ids))
    return GuideSpec(grammar)
