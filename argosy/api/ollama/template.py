"""Ollama's `template` override on /api/generate: the common forms of its Go templates.

Supported: text, `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}` (the prompt ends there:
what follows it is the model's turn to write), `{{ if .System }}` / `{{ if .Prompt }}` with an
optional `{{ else }}` and their `{{ end }}`, and the `{{-` / `-}}` trimming of whitespace next
to an action. Anything else (ranges over `.Messages`, `.Tools`, functions, comparisons) is a
400 naming `template` and the action, never a half-rendered prompt.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

from argosy.errors import InvalidRequestError

_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
_FIELDS = ("System", "Prompt", "Response")
MAX_TEMPLATE_CHARS = 64 * 1024


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid 'template': {message}.", "template")


@dataclass
class _Node:
    text: str | None = None  # literal text
    value: str | None = None  # {{ .Field }}
    condition: str | None = None  # {{ if .Field }}
    then: list[_Node] = field(default_factory=list)
    otherwise: list[_Node] = field(default_factory=list)


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text", literal) and ("action", body) in order, whitespace trimmed as `-` asks."""
    tokens: list[tuple[str, str]] = []
    position = 0
    trim_next = False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if text:
            tokens.append(("text", text))
        tokens.append(("action", match.group(2).strip()))
        trim_next = bool(match.group(3))
        position = match.end()
    rest = template[position:]
    if "{{" in rest:
        raise _refuse("an action is not closed with '}}'")
    if trim_next:
        rest = rest.lstrip()
    if rest:
        tokens.append(("text", rest))
    return tokens


def _field_of(expression: str) -> str | None:
    name = expression.removeprefix(".")
    return name if expression.startswith(".") and name in _FIELDS else None


def _parse(template: str) -> list[_Node]:
    root: list[_Node] = []
    stack: list[tuple[_Node, list[_Node]]] = []  # open ifs and the branch being filled
    current = root
    for kind, value in _tokens(template):
        if kind == "text":
            current.append(_Node(text=value))
            continue
        if value.startswith("/*") and value.endswith("*/"):
            continue  # a comment
        named = _field_of(value)
        if named is not None:
            current.append(_Node(value=named))
        elif value.startswith("if "):
            condition = _field_of(value[3:].strip())
            if condition is None:
                raise _refuse(
                    f"only '{{{{ if .System }}}}' and '{{{{ if .Prompt }}}}' conditions are supported, got '{{{{ {value} }}}}'"
                )
            node = _Node(condition=condition)
            current.append(node)
            stack.append((node, current))
            current = node.then
        elif value == "else":
            if not stack or current is not stack[-1][0].then:
                raise _refuse("'{{ else }}' outside an '{{ if }}'")
            current = stack[-1][0].otherwise
        elif value == "end":
            if not stack:
                raise _refuse("'{{ end }}' without an '{{ if }}'")
            _, current = stack.pop()
        else:
            raise _refuse(
                f"'{{{{ {value} }}}}' is not supported here (only .System, .Prompt, .Response and "
                "if/else/end on them)"
            )
    if stack:
        raise _refuse("an '{{ if }}' is not closed with '{{ end }}'")
    return root


class _ResponseReached(Exception):
    pass


def _render(nodes: list[_Node], values: dict[str, str], out: list[str]) -> None:
    for node in nodes:
        if node.text is not None:
            out.append(node.text)
        elif node.value == "Response":
            raise _ResponseReached
        elif node.value is not None:
            out.append(values[node.value])
        elif node.condition is not None:
            _render(node.then if values[node.condition] else node.otherwise, values, out)


def render_ollama_template(template: str, *, system: str | None, prompt: str) -> str:
    """The prompt `template` writes for this system and prompt (a 400 if it cannot)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise _refuse(f"at most {MAX_TEMPLATE_CHARS} characters, got {len(template)}")
    out: list[str] = []
    with contextlib.suppress(_ResponseReached):  # the prompt ends where the response begins
        _render(_parse(template), {"System": system or "", "Prompt": prompt, "Response": ""}, out)
    return "".join(out)
