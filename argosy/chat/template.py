"""The model's own Jinja chat template, rendered the way `transformers` renders it.

Chat templates come with the model and are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with the settings and helpers `transformers` gives them
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a non-escaping `tojson`,
`strftime_now`, a plain `dict`, an underscore-refusing `namespace`), so a template renders
here exactly as `apply_chat_template(..., tokenize=False)` renders it. A template that
raises (say "roles must alternate") is the client's conversation at fault: an
InvalidRequestError carrying the template's own words. A final message can be left open to
be continued (`continue_final_message`, as transformers has it): the text is cut right after
its content, before the template's end-of-turn.

Rendering is bounded (`_RenderBudget`): a template that loops for long or builds an enormous
prompt is stopped with a 400 naming `messages` once it has run `render_deadline_s` or produced
a value or an output past `max_render_chars` characters. Jinja cannot be interrupted from
outside, so the template checks itself, at the points every long render must pass through:
each iteration of every `{% for %}` (the parsed template is rewritten so each loop's iterable
is wrapped), each call (methods, macros, `loop(...)` recursion: the sandbox's `call` hook),
each `+ * ** %` (intercepted; `+`, `*` and `**` are refused before they build a value too large)
and each `~` and filter result, and each piece of output. Limits: one C-level operation runs
to its end before the next check (`'x'.ljust(10**9)` allocates its gigabyte first, a regex in
a filter runs to completion), so the deadline bounds the template's own steps, not any single
library call; recursion past Python's limit and `range()` past the sandbox's 100,000 items
are refused as errors of the template.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from argosy.errors import InvalidRequestError

# A message's reasoning travels under several names; templates read the first
# (transformers fills all of them the same way).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}."
            )


# A real template renders in milliseconds (SmolLM2's: a 25 MiB conversation, the largest body
# the server reads by default, in well under a second); the deadline is far above that and
# bounds how long a runaway template holds the thread rendering it.
RENDER_DEADLINE_S = 5.0
# Above the default 25 MiB body limit, so any conversation the server accepts can render; a
# template that amplifies its input past this is stopped.
MAX_RENDER_CHARS = 32 * 1024 * 1024
_MAX_INT_BITS = 1 << 16  # an integer past this many bits is no prompt (and slow to compute)
_BUDGET_VARIABLE = "argosy_render_budget"  # the render variable that carries the budget
_ITER_FILTER = "argosy_bounded_iter"
_SIZE_FILTER = "argosy_bounded_value"


class _RenderLimitError(Exception):
    """A render ran past its deadline or its size bound (becomes a 400 naming `messages`)."""


class _RenderBudget:
    """One render's deadline and size bound, checked by the hooks in `_BoundedEnvironment`."""

    def __init__(self, deadline_s: float, max_chars: int) -> None:
        self.deadline_s = deadline_s
        self.max_chars = max_chars
        self._deadline = time.monotonic() + deadline_s

    def tick(self) -> None:
        if time.monotonic() > self._deadline:
            raise _RenderLimitError(
                f"The chat template took longer than {self.deadline_s:g} s to render these messages."
            )

    def check_size(self, value: Any) -> Any:
        if isinstance(value, str | list | tuple | dict | bytes):
            self.check_length(len(value))
        return value

    def check_length(self, length: int) -> None:
        if length > self.max_chars:
            raise _RenderLimitError(
                f"The chat template produced more than {self.max_chars} characters for these messages."
            )

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.tick()
            yield item


def _budget_of(context: Context) -> _RenderBudget | None:
    # the render's variables are the context's parent (macros and loops share that context)
    budget = context.parent.get(_BUDGET_VARIABLE)
    return budget if isinstance(budget, _RenderBudget) else None


@jinja2.pass_context
def _bounded_iter(context: Context, iterable: Any) -> Any:
    budget = _budget_of(context)
    return iterable if budget is None else budget.bounded_iter(iterable)


@jinja2.pass_context
def _bounded_value(context: Context, value: Any) -> Any:
    budget = _budget_of(context)
    return value if budget is None else budget.check_size(value)


class _BoundLoopsAndValues(NodeTransformer):
    """Rewrites a parsed template so every `{% for %}` iterates through `_bounded_iter` and the
    result of every `~` and every filter passes through `_bounded_value`. (A filter with no
    operand is a `{% filter %}` / `{% set x | f %}` block's: its result is output or assigned
    whole, and left as it is.)"""

    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 - the visitor's naming
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _ITER_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802 - the visitor's naming
        self.generic_visit(node)
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)

    def visit_Filter(self, node: nodes.Filter) -> nodes.Node:  # noqa: N802 - the visitor's naming
        self.generic_visit(node)
        if node.node is None or node.name in (_ITER_FILTER, _SIZE_FILTER):
            return node
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox plus the render budget's hooks (see the module doc)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget_of(__context)
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.tick()
        return budget.check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget_of(context)
        if budget is None:
            return super().call_binop(context, operator, left, right)
        if operator == "+":  # the common one (templates build prompts with it): checked exactly, no tick
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                budget.check_length(len(left) + len(right))
            return left + right
        budget.tick()
        _check_operands(budget, operator, left, right)
        return budget.check_size(super().call_binop(context, operator, left, right))


_SEQUENCES = (str, list, tuple)


def _check_operands(budget: _RenderBudget, operator: str, left: Any, right: Any) -> None:
    """Refuse `*` and `**` whose result would be past the bound, before building it."""
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(items, _SEQUENCES) and isinstance(times, int) and times > 0:
                budget.check_length(len(items) * times)
    if operator in ("*", "**") and _result_bits(operator, left, right) > _MAX_INT_BITS:
        raise _RenderLimitError(f"The chat template computes a number of more than {_MAX_INT_BITS} bits.")


def _result_bits(operator: str, left: Any, right: Any) -> float:
    """About how many bits the integer `left * right` or `left ** right` has (0 if either is
    not an integer)."""
    if not isinstance(left, int) or not isinstance(right, int):
        return 0.0
    if operator == "*":
        return float(left.bit_length() + right.bit_length())
    if right <= 0 or abs(left) <= 1:
        return 0.0
    return right * math.log2(abs(left))


def _compared_strings(syntax: nodes.Template) -> dict[str, tuple[str, ...]]:
    """Per variable, the string constants the template compares it with (`x == "high"`,
    `"low" != x`, `x in ["low", "high"]`), in the order they are written: the values it
    tells apart (a template's `reasoning_effort` levels)."""
    found: dict[str, dict[str, None]] = {}
    for compare in syntax.find_all(nodes.Compare):
        left = compare.expr
        for operand in compare.ops:
            right = operand.expr
            for name, other in ((left, right), (right, left)):
                if not isinstance(name, nodes.Name):
                    continue
                items = other.items if isinstance(other, nodes.List | nodes.Tuple) else [other]
                strings = [i.value for i in items if isinstance(i, nodes.Const) and isinstance(i.value, str)]
                found.setdefault(name.name, {}).update(dict.fromkeys(strings))
            left = right
    return {name: tuple(values) for name, values in found.items() if values}


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters[_ITER_FILTER] = _bounded_iter
    env.filters[_SIZE_FILTER] = _bounded_value
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# Put after the content of a message to continue; the rendered text is cut where it is. Its
# trailing space shows whether the template kept the content's trailing whitespace.
_CONTINUE_MARKER = "<|argosy-continue-final-message|> "


def _cut_at_marker(rendered: str) -> str:
    """`rendered` up to the last continue marker (see ChatTemplate.render)."""
    marker = _CONTINUE_MARKER.rstrip()
    position = rendered.rfind(marker)
    if position < 0:
        raise InvalidRequestError(
            "The final message cannot be continued: the chat template does not write its content.",
            "messages",
        )
    if rendered.startswith(_CONTINUE_MARKER, position):
        return rendered[:position]
    return rendered[:position].rstrip()


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One model's compiled template plus the special tokens it is rendered with; each render
    bounded by `render_deadline_s` and `max_render_chars` (see the module doc)."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        render_deadline_s: float = RENDER_DEADLINE_S,
        max_render_chars: int = MAX_RENDER_CHARS,
    ) -> None:
        environment = _environment()
        try:
            syntax = environment.parse(source)
            # The string values each variable is compared with (`reasoning_effort` levels), read
            # first: finding the variables compiles the tree, which folds constant lists.
            self.compared_strings = _compared_strings(syntax)
            # The variables the template reads (`tools`, `enable_thinking`, `reasoning_effort`...):
            # one it does not read is not honoured, whatever value it is given.
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(syntax))
            bounded = _BoundLoopsAndValues().visit(syntax)
            bounded.set_environment(environment)
            self._template = environment.from_string(bounded)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidRequestError(
                f"The model's chat template does not compile: {exc}", "chat_template"
            ) from exc
        self.source = source
        self.render_deadline_s = render_deadline_s
        self.max_render_chars = max_render_chars
        self._special_tokens = {
            name: value
            for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
            if value is not None
        }

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text. Keys whose value is None are dropped from messages (templates test
        for a missing key, not for None), as transformers does.

        `continue_final_message` (with add_generation_prompt False, as transformers has it):
        the text ends right after the final message's content, whatever the template writes
        after it (its end-of-turn), so the model carries on that text. The content is rendered
        with a marker after it and the text cut at the marker's last occurrence; a template that
        trims the content's trailing whitespace (the marker's own trailing space is gone) has the
        text before the cut trimmed too, as its rendering of the content alone would be."""
        conversation = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        if continue_final_message:
            if not conversation:
                raise InvalidRequestError("There is no final message to continue.", "messages")
            final = conversation[-1]
            content = final.get("content") or ""
            if not isinstance(content, str):
                raise InvalidRequestError("The final message to continue has no text content.", "messages")
            conversation[-1] = {**final, "content": content + _CONTINUE_MARKER}
        rendered = self._render(conversation, add_generation_prompt, tools, template_kwargs)
        return _cut_at_marker(rendered) if continue_final_message else rendered

    def _render(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> str:
        budget = _RenderBudget(self.render_deadline_s, self.max_render_chars)
        variables = {
            **self._special_tokens,
            "tools": tools,
            "documents": None,
            **template_kwargs,
            "messages": conversation,
            "add_generation_prompt": add_generation_prompt,
            _BUDGET_VARIABLE: budget,
        }
        try:
            parts: list[str] = []
            num_chars = 0
            for part in self._template.generate(**variables):
                num_chars += len(part)
                budget.check_length(num_chars)
                budget.tick()
                parts.append(part)
            return "".join(parts)
        except _RenderLimitError as exc:
            raise InvalidRequestError(str(exc), "messages") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(str(exc) or type(exc).__name__, "messages") from exc
        except RecursionError as exc:
            raise InvalidRequestError(
                "The chat template recursed too deeply on these messages.", "messages"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            # The template choked on the shape of this conversation: still the request's doing.
            raise InvalidRequestError(
                f"The chat template failed on these messages: {exc}", "messages"
            ) from exc
