"""Channel parsers: generated text -> text / reasoning / tool-call events, per model family.

One parser per choice of a request: `feed(delta)` as text is generated, `finish()` once at the
end. Events are the neutral ones of argosy/chat/events.py; a dialect renders them. The
non-streaming result (`parse_text`, or `ChannelCollector` over the streamed events) is the same
events collected, so streaming and non-streaming agree by construction, and the events do not
depend on how the text was cut into deltas (up to merging adjacent deltas of one kind).

This module is the entry point. The state machine is family_parser.py (its decisions on a
call unit in unit_decisions.py, its state as data in call_unit.py, its output runs in
event_runs.py, whitespace at markers in segment.py, marker search in markers.py, markerless
calls in bare_call.py and call_check.py, the schema check of `auto` calls in call_guard.py);
collector.py gathers the non-streaming result.

Streaming: text is emitted as soon as it cannot be the start of a marker; only a possible
partial marker is held back. A call is held until its name is known; then `ToolCallStart`,
then its arguments as the model writes them (`ToolCallArgsDelta` pieces joining to the model's
own JSON text of the arguments, exactly as in the non-streaming result), then `ToolCallEnd`.
In `auto` mode a call of a tool with a schema (`ParserOptions.call_schemas`) is held until its
JSON closes, since it is a call only if its arguments pass the schema (call_guard.py); it is
then sent whole. Calls are numbered 0, 1, 2... in order.

Decisions (where SPEC §2 is silent):
- If a call's name is not among `tool_names`, the call's raw text (markers included) comes
  back as content with a ToolParseFailure "unknown_tool"; text that breaks before its name is
  known ("invalid_json", "missing_name") likewise. Once the name is known the call is a call:
  a later failure ("invalid_json", "bad_arguments", "unterminated") keeps the call, with the
  arguments text the model wrote (possibly not valid JSON, as OpenAI's own calls may be), plus
  a ToolParseFailure carrying its `call_index`.
- A call object that is complete is a call even if its closing marker never came. A call that
  breaks mid-JSON runs to its closing marker, the next opening marker, or the end of output.
- The output ending inside a call (before its JSON is complete) is a failure with
  `is_unterminated` set: the caller says finish reason "length".
- Arguments that are a JSON object the tool's schema refuses (`call_schemas`, `auto` mode):
  the call (markers or not) is no call. Its text comes back as content with a
  ToolParseFailure "invalid_arguments" (the answer names `tool_call_invalid`, not
  `tool_call_unparsed`), or, with `can_repair_calls`, it is handed to the core whole as a
  ToolCallInvalid keeping its number, for a constrained retry (argosy/core/tool_repair.py).
  Arguments that are no JSON object keep the rule above (a call, with its failure).
- `can_call_in_parallel=False`: only the first call is a call; later calls are left out of
  the message, each reported as ToolParseFailure "extra_call".
- Text between a complete call and its closing marker is content ("unexpected_text").
- Whitespace touching a marker is tidied as if the marker were not there: content never
  starts or ends with it, and text on both sides of calls keeps one whitespace run (see
  Segment). Text that touches no marker is left exactly as generated.
- Reasoning opens only at the start of the output (`<think>` later on is text), once. Tool
  markers inside reasoning are reasoning. A disabled channel is not parsed: its markers and
  text are content (tool_choice "none": calls come back as text).
- Llama's markerless JSON call is recognised only where it opens the output, and only while
  its keys read like a call (name / parameters / arguments / type); otherwise it is plain text.
- Hermes-syntax models (Qwen2.5) may leave the markers out: where the answer starts, JSON
  objects, a list of them, or either in one ```json fence are held until they close and are
  calls only when every one names a declared tool with arguments valid for its schema and
  grounded in the conversation (`ParserOptions.bare_calls`; argosy/chat/bare_call.py and
  call_check.py); otherwise all of it is text, with a ToolParseFailure ("unknown_tool",
  "bad_arguments", "ungrounded_arguments", "invalid_arguments", "invalid_json",
  "call_too_long") when it was a call attempt. Such calls are sent whole (start, all
  arguments, end) once decided.
- `is_call_forced` (tool_choice "required" or named, enforced by a grammar): the output after
  any reasoning is calls, in the family's marker syntax (the grammar's `<tool_call>` shape)
  or bare JSON: call objects one after another, or one array of them.
- Arguments are the model's own JSON text of the arguments object (not re-serialized), so
  streamed fragments and the non-streaming arguments are the same string; a JSON string
  holding an object is unwrapped, and missing or null arguments are "{}".
"""

from __future__ import annotations

from collections.abc import Callable

from argosy.chat.collector import ChannelCollector, ParsedOutput, ParsedToolCall, parse_text
from argosy.chat.families import ChatFamily, get_family
from argosy.chat.families.json_call import JSON_WHITESPACE
from argosy.chat.family_parser import FamilyChannelParser
from argosy.chat.parser_options import ChannelParser, ParserOptions

__all__ = [
    "ChannelCollector",
    "ChannelParser",
    "FamilyChannelParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ParserOptions",
    "make_channel_parser",
    "parse_text",
    "prompt_opens_reasoning",
]


def make_channel_parser(
    family: ChatFamily | str,
    options: ParserOptions | None = None,
    *,
    choice_index: int = 0,
    new_call_id: Callable[[], str] | None = None,
) -> ChannelParser:
    """A parser for one choice; `new_call_id` defaults to the family's (`call_` + 24 chars)."""
    if isinstance(family, str):
        family = get_family(family)
    return FamilyChannelParser(family, options, choice_index=choice_index, new_call_id=new_call_id)


def prompt_opens_reasoning(family: ChatFamily, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (Qwen3-style templates
    with enable_thinking put `<think>\\n` in the generation prompt)."""
    markers = family.reasoning_markers
    return markers is not None and prompt_text.rstrip(JSON_WHITESPACE).endswith(markers[0])
