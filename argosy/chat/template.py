"""The model's own Jinja chat template, rendered the way `transformers` renders it.

Chat templates come with the model and are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with the settings and helpers `transformers` gives them
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a non-escaping `tojson`,
`strftime_now`, a plain `dict`, an underscore-refusing `namespace`), so a template renders
here exactly as `apply_chat_template(..., tokenize=False)` renders it. A template that
raises (say "roles must alternate") is the client's conversation at fault: an
InvalidRequestError carrying the template's own words.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One model's compiled template plus the special tokens it is rendered with."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            syntax = environment.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidRequestError(
                f"The model's chat template does not compile: {exc}", "chat_template"
            ) from exc
        self.source = source
        # The variables the template reads (`tools`, `enable_thinking`, `reasoning_effort`...):
        # one it does not read is not honoured, whatever value it is given.
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(syntax))
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
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text. Keys whose value is None are dropped from messages (templates test
        for a missing key, not for None), as transformers does."""
        conversation = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        variables = {
            **self._special_tokens,
            "tools": tools,
            "documents": None,
            **template_kwargs,
            "messages": conversation,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(str(exc) or type(exc).__name__, "messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # The template choked on the shape of this conversation: still the request's doing.
            raise InvalidRequestError(
                f"The chat template failed on these messages: {exc}", "messages"
            ) from exc
