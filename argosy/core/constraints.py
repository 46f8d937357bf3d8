"""tools / tool_choice / parallel_tool_calls / response_format -> grammar and parser options.

Dialect-free: it reads the neutral ToolDefinition / ToolChoice / OutputFormat
(argosy/chat/messages.py), so every dialect gets the same rules and the same errors.

- `auto`: the tools go into the prompt; calls in the output are parsed, nothing is forced.
  Calls the model writes without its family's markers (bare JSON where the answer starts)
  are calls only when they name a declared tool with schema-valid, grounded arguments
  (argosy/chat/call_check.py); the check carries the tools' schemas and the conversation.
  A call that parses but whose arguments fail its tool's schema (markers or not) is written
  again under that schema's grammar while the request's repair budget lasts, else it comes
  back as text named `tool_call_invalid` (argosy/core/tool_repair.py).
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
cannot be called (the answer must be the JSON, never read as calls) and `tools` is named as
degraded.
Refusals (HTTP 400, `param` naming the field): a named tool that is not declared, a forced
call with no tools, json_schema without a schema, duplicate tool names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from argosy.chat.call_check import BareCallCheck
from argosy.chat.families import CallSyntax
from argosy.chat.messages import ChatInput, Message, OutputFormat, ToolChoice, ToolDefinition
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
# A counted repetition in a `pattern` (`a{n}`, `a{m,}`, `a{m,n}`) is unrolled by xgrammar 0.2.9
# at a cost that grows about quadratically with the count (SmolLM2's vocabulary, a busy CPU:
# `^a{1,1000}$` 0.17 s, `^[0-9]{1,3000}$` 1.3 s, `^a{5000}$` 6 s, `^a{1,10000}$` 20 s), while
# `maxLength` / `maxItems` cost nothing at any size. So one count is bounded, and so is the sum
# of squared counts over a request's patterns (4,000,000: four quantifiers of 1000, about 0.7 s;
# an ISO date's `\d{4}-\d{2}-\d{2}` costs 24). What slips past both meets the grammar
# service's compile deadline.
MAX_PATTERN_REPEAT = 1000
MAX_PATTERN_COST = 4_000_000  # sum of count**2 over every counted repetition of the request
# All tools' parameter schemas together (a forced call compiles them as one grammar: 128 tools
# of 64 KiB would be seconds of compile and more prompt than any context holds).
MAX_TOOL_SCHEMAS_BYTES = 512 * 1024

# Keywords whose values are data, not schemas (a `pattern` key inside is not a regex), and
# keywords whose values map names to schemas (a key there is a name, not a keyword).
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_schema_size(schema: Any, param: str) -> tuple[int, int]:
    """A 400 naming `param` for a schema past MAX_SCHEMA_BYTES or MAX_SCHEMA_DEPTH, or with a
    `pattern` (or `patternProperties` key) past MAX_PATTERN_REPEAT or MAX_PATTERN_COST; else
    the schema's size in bytes (compact JSON) and its pattern cost (sum of squared counts)."""
    if schema is None:
        return 0, 0
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
    cost = 0
    for pattern in _patterns(schema):
        counts = _repeat_counts(pattern)
        largest = max(counts, default=0)
        if largest > MAX_PATTERN_REPEAT:
            shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
            raise InvalidRequestError(
                f"The schema's pattern {shown!r} repeats {largest} times; a counted repetition "
                f"({{n}}, {{m,}}, {{m,n}}, counts of nested groups multiplied) may repeat at most "
                f"{MAX_PATTERN_REPEAT} times (use maxLength to bound a string's length).",
                param,
            )
        cost += sum(count * count for count in counts)
    _check_pattern_cost(cost, param)
    return size, cost


def _check_pattern_cost(cost: int, param: str) -> None:
    if cost > MAX_PATTERN_COST:
        raise InvalidRequestError(
            f"The schemas' patterns repeat too much to compile quickly: the sum of their squared "
            f"repetition counts is {cost}, at most {MAX_PATTERN_COST} is allowed (fewer or smaller "
            "{n} / {m,n} counts; maxLength bounds a string's length at no cost).",
            param,
        )


def _patterns(schema: Any) -> Iterator[str]:
    """Every regex in `schema`: `pattern` values and `patternProperties` keys (the depth is
    checked first, so the recursion is bounded)."""
    if isinstance(schema, list):
        for item in schema:
            yield from _patterns(item)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key == "pattern" and isinstance(value, str):
            yield value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            if key == "patternProperties":
                yield from (name for name in value if isinstance(name, str))
            for item in value.values():
                yield from _patterns(item)
        else:
            yield from _patterns(value)


def _repeat_counts(pattern: str) -> list[int]:
    """The effective counts of `pattern`'s counted repetitions: the larger of m and n in
    `{m,n}`, times the counts of the groups around it (`(a{1,10}){1,10}` unrolls `a` up to 100
    times). Escapes and character classes are skipped (there `{` is a literal); a count of more
    than nine digits, or a product past 10**9, reads as 10**9."""
    levels: list[list[int]] = [[]]  # counts inside each open group, outermost first
    position = 0
    is_in_class = False
    while position < len(pattern):
        char = pattern[position]
        position += 1
        if char == "\\":
            position += 1
        elif is_in_class:
            is_in_class = char != "]"
        elif char == "[":
            is_in_class = True
            if pattern.startswith("^]", position) or pattern.startswith("]", position):
                position = pattern.index("]", position) + 1  # a leading `]` is a literal
        elif char == "(":
            levels.append([])
        elif char == ")" and len(levels) > 1:
            inner = levels.pop()
            count = _count_at(pattern, position)
            if count is None:
                levels[-1].extend(inner)
            else:
                levels[-1].extend(min(each * count[0], 10**9) for each in inner)
                levels[-1].append(count[0])
                position = count[1]
        elif char == "{" and (count := _count_at(pattern, position - 1)) is not None:
            levels[-1].append(count[0])
            position = count[1]
    return [each for level in levels for each in level]


def _count_at(pattern: str, position: int) -> tuple[int, int] | None:
    """The count of a `{m}` / `{m,}` / `{m,n}` quantifier at `position`, and where it ends."""
    match = _REPEAT.match(pattern, position)
    if match is None:
        return None
    numbers = [int(digits) if len(digits) <= 9 else 10**9 for digits in match.groups() if digits]
    return max(numbers), match.end()


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
    total_bytes = total_cost = 0
    for position, tool in enumerate(tools):
        num_bytes, cost = check_schema_size(tool.parameters, f"tools[{position}]")
        total_bytes += num_bytes
        total_cost += cost
        if total_bytes > MAX_TOOL_SCHEMAS_BYTES:
            raise InvalidRequestError(
                f"The tools' parameter schemas are more than {MAX_TOOL_SCHEMAS_BYTES} bytes together "
                f"(as JSON, through tools[{position}]).",
                "tools",
            )
        _check_pattern_cost(total_cost, "tools")
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
    wants_json = chat.output_format is not None and chat.output_format.kind != "text"
    is_answer_json = wants_json and not choice.is_forced
    is_bare_call_judged = uses_tools and not (choice.is_forced or is_answer_json)
    constraints = ChatConstraints(
        prompt_tools=list(chat.tools) if uses_tools else [],
        parser_options=ParserOptions(
            has_tool_calls=uses_tools and not is_answer_json,
            tool_names=frozenset(tool.name for tool in chat.tools),
            can_call_in_parallel=parallel,
            is_call_forced=choice.is_forced,
            bare_calls=bare_call_check(chat) if is_bare_call_judged else None,
            call_schemas={tool.name: tool.parameters for tool in chat.tools} if is_bare_call_judged else None,
        ),
    )
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


def bare_call_check(chat: ChatInput) -> BareCallCheck:
    """What a markerless call is checked against: the tools' schemas and the conversation."""
    return BareCallCheck(
        tool_schemas={tool.name: tool.parameters for tool in chat.tools},
        conversation=tuple(_conversation_texts(chat.messages)),
    )


def _conversation_texts(messages: list[Message]) -> Iterator[str]:
    for message in messages:
        if message.content:
            yield message.content
        for tool_call in message.tool_calls:
            yield tool_call.arguments


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
    grammar: GrammarSpec | None,
    *,
    start_ids: list[int],
    end_ids: list[int],
    is_reasoning_open: bool,
    may_reason: bool,
    max_reasoning_tokens: int | None = None,
) -> GuideSpec | None:
    """A guide that leaves a thinking model's reasoning free (or held to `max_reasoning_tokens`)
    and constrains what follows it with `grammar` (None: the answer is free).

    The prompt opened the reasoning block: the grammar starts after the end marker. The model
    may open one itself (a one-token start marker, thinking not switched off): the first token
    is that marker or the grammar's. Otherwise the grammar holds from the first token, and no
    budget can be kept (none is: see `can_budget_reasoning`). None: nothing to guide.
    """
    if not can_budget_reasoning(
        start_ids, end_ids, is_reasoning_open=is_reasoning_open, may_reason=may_reason
    ):
        max_reasoning_tokens = None
    if grammar is None and max_reasoning_tokens is None:
        return None
    if is_reasoning_open and end_ids:
        return GuideSpec(
            grammar, "delayed", end_token_ids=tuple(end_ids), max_reasoning_tokens=max_reasoning_tokens
        )
    if may_reason and len(start_ids) == 1 and end_ids:
        return GuideSpec(
            grammar,
            "optional",
            start_token_id=start_ids[0],
            end_token_ids=tuple(end_ids),
            max_reasoning_tokens=max_reasoning_tokens,
        )
    return GuideSpec(grammar)


def can_budget_reasoning(
    start_ids: list[int], end_ids: list[int], *, is_reasoning_open: bool, may_reason: bool
) -> bool:
    """Whether the guide can see where reasoning starts and force its end: the end marker is
    known, and the prompt opened the reasoning or the model opens it with a one-token marker."""
    if not end_ids:
        return False
    return is_reasoning_open or (may_reason and len(start_ids) == 1)
