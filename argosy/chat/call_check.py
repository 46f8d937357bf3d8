"""Whether markerless JSON is tool calls: declared names, schema-valid, grounded arguments.

A call written without the family's markers (argosy/chat/bare_call.py) is ambiguous: the
same JSON may be the answer itself. It becomes calls only when `judge_calls` finds every
value a call object (keys among the family's name / arguments keys, a string name) and
every call

- names a declared tool (else "unknown_tool"),
- has arguments that are a JSON object (or a JSON string holding one, or none: `{}`; else
  "bad_arguments"),
- is grounded: some word or number of its arguments occurs in the conversation (the
  messages' text and earlier calls' arguments, not the tool list), unless its arguments hold
  no free text at all (else "ungrounded_arguments"), and
- has arguments valid for that tool's parameters schema (else "invalid_arguments").

The schema comes last on purpose: a call that fails only its schema was meant as a call (a
declared tool, grounded arguments), so it is the one the core may write again under the
schema's grammar (`Verdict.invalid_call`, argosy/core/tool_repair.py); a made-up call that
also fails its schema must stay text, never be repaired into a call.

Why the grounding rule: Qwen2.5-Coder-0.5B with tools declared answers "What is 2+2?",
"Hello!" or "How many legs does a spider have?" with a well-formed
`{"name": "get_weather", "arguments": {"city": "London", ...}}` (greedy: 6 of 20 questions
that need no tool, measured), while its real calls name what the user asked about ("Paris",
"Tokyo", "100"). Words that only restate the schema (enum and const values: "celsius") and a
few very common words are no evidence. A call the rule refuses stays text, reported like any
call that did not parse.

Objects that are not call objects at all (`{"answer": 4}`, `{"name": "Ann", "age": 3}`) are
plain text with no failure: they were never calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from argosy.chat.events import INVALID_ARGUMENTS
from argosy.chat.families.base import CallSyntax
from argosy.chat.families.json_call import CONSUMED, DONE, ERROR, CallObjectReader, ValueScanner

_WORD = re.compile(r"[^\W_]+")  # letters and digits: "America/New_York" -> america, new, york
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# Too common to tell a call about the question from one made up: no evidence either way.
_COMMON_WORDS = frozenset(
    {"the", "and", "for", "you", "your", "are", "was", "what", "who", "how", "why", "when", "where"}
    | {"which", "this", "that", "with", "from", "have", "has", "can", "not", "but", "all", "any"}
    | {"get", "set", "use", "one"}
)
_MIN_WORD_CHARS = 3  # shorter words ("in", "a", "is") match nearly any conversation


@dataclass(frozen=True, slots=True)
class BareCallCheck:
    """What a markerless call is checked against: the declared tools' parameter schemas
    (None: any object) and the conversation's texts (for grounding)."""

    tool_schemas: Mapping[str, dict[str, Any] | None]
    conversation: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class BareCall:
    name: str
    arguments: str  # the model's own JSON text of the arguments object
    raw: str  # the call object's text, as written


@dataclass(frozen=True, slots=True)
class Verdict:
    """`calls` when the values are calls; else `failure` (None: not call objects at all).
    `invalid_call`: the unit is one call that passes every rule but its schema (failure
    "invalid_arguments"), which may be repaired."""

    calls: list[BareCall] | None = None
    failure: str | None = None
    invalid_call: BareCall | None = None


def is_call_key(key: str, syntax: CallSyntax) -> bool:
    return key in syntax.name_keys or key in syntax.args_keys


def judge_calls(values: list[str], syntax: CallSyntax, check: BareCallCheck) -> Verdict:
    """The verdict on complete JSON value texts, each a call object or a list of them."""
    objects: list[str] = []
    for text in values:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return Verdict()
        items = value if isinstance(value, list) else [value]
        if not items or not all(_is_call_object(item, syntax) for item in items):
            return Verdict()
        split = _object_texts(text) if isinstance(value, list) else [text]
        if split is None or len(split) != len(items):
            return Verdict()
        objects += split
    calls: list[BareCall] = []
    invalid: list[BareCall] = []
    words: frozenset[str] | None = None
    for raw in objects:
        call = _read_call(raw, syntax)
        if call is None:
            return Verdict()
        name, arguments = call
        if name not in check.tool_schemas:
            return Verdict(failure="unknown_tool")
        schema = check.tool_schemas[name]
        decoded = _json_object(arguments)
        if decoded is None:
            return Verdict(failure="bad_arguments")
        evidence = set(_evidence(decoded)) - _schema_words(schema)
        if evidence:
            words = _conversation_words(check.conversation) if words is None else words
            if not evidence & words:
                return Verdict(failure="ungrounded_arguments")
        calls.append(BareCall(name, arguments, raw))
        if not _is_valid(decoded, schema):
            invalid.append(calls[-1])
    if invalid:
        return Verdict(failure=INVALID_ARGUMENTS, invalid_call=invalid[0] if len(calls) == 1 else None)
    return Verdict(calls=calls)


def fails_schema(arguments: str, schema: dict[str, Any] | None) -> bool:
    """Whether `arguments` is a JSON object that `schema` refuses (text that is no JSON object
    is another failure: the parser's "invalid_json" / "bad_arguments")."""
    decoded = _json_object(arguments)
    return decoded is not None and not _is_valid(decoded, schema)


def fits_schema(arguments: str, schema: dict[str, Any] | None) -> bool:
    """Whether `arguments` is a JSON object valid for `schema` (None: any object)."""
    decoded = _json_object(arguments)
    return decoded is not None and _is_valid(decoded, schema)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _is_call_object(item: Any, syntax: CallSyntax) -> bool:
    if not isinstance(item, dict) or not all(is_call_key(key, syntax) for key in item):
        return False
    names = [item[key] for key in syntax.name_keys if key in item]
    return len(names) == 1 and isinstance(names[0], str)


def _object_texts(text: str) -> list[str] | None:
    """The element texts of a JSON array of objects, as written (the array is valid JSON)."""
    position, objects = 1, list[str]()
    while True:
        position = _skip_space(text, position)
        if text[position] == "]":
            return objects
        if text[position] != "{":
            return None
        end, status = ValueScanner().scan(text, position)
        if status != DONE:
            return None
        objects.append(text[position:end])
        position = _skip_space(text, end)
        if text[position] == ",":
            position += 1


def _skip_space(text: str, position: int) -> int:
    while text[position] in " \t\r\n":
        position += 1
    return position


def _read_call(raw: str, syntax: CallSyntax) -> tuple[str, str] | None:
    """(name, arguments text) of one call object's text: the arguments as the model wrote
    them, a JSON string holding them decoded, none or null as `{}`."""
    reader, position = CallObjectReader(syntax), 0
    while True:
        consumed, status = reader.read(raw[position:])
        position += consumed
        if status == DONE:
            break
        if status in (CONSUMED, ERROR):
            return None
    if reader.name is None:
        return None
    arguments = "".join(reader.args_parts)
    if reader.args_kind is None or arguments == "null":
        return reader.name, "{}"
    if reader.args_kind == "string":
        decoded = json.loads(arguments)
        return reader.name, decoded if isinstance(decoded, str) else arguments
    return reader.name, arguments


def _is_valid(arguments: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    if schema is None:
        return True
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        return bool(validator.is_valid(arguments))
    except Exception:  # noqa: BLE001 - a schema the validator cannot use (a bad keyword value,
        # an unresolvable $ref) checks nothing more than "an object": the name was declared
        return True


def _evidence(value: Any) -> Iterator[str]:
    """The words and numbers of an arguments value that could name what the user asked."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _evidence(item)
    elif isinstance(value, list):
        for item in value:
            yield from _evidence(item)
    elif isinstance(value, str):
        yield from _words(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield _number_text(value)


def _words(text: str) -> Iterator[str]:
    for word in _WORD.findall(text.lower()):
        if word.isdigit() or (len(word) >= _MIN_WORD_CHARS and word not in _COMMON_WORDS):
            yield word


def _number_text(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _schema_words(schema: Any) -> set[str]:
    """Words of the schema's enum and const values: choosing one is no evidence."""
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("enum", "const"):
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, str):
                        found.update(_words(item))
            else:
                found |= _schema_words(value)
    elif isinstance(schema, list):
        for item in schema:
            found |= _schema_words(item)
    return found


def _conversation_words(texts: tuple[str, ...]) -> frozenset[str]:
    words: set[str] = set()
    for text in texts:
        words.update(_words(text))
        words.update(number.replace(",", "") for number in _NUMBER.findall(text))
    return frozenset(words)
