"""CallGuard: what the channel parser checks of a call's arguments in `auto` mode, and the
output it keeps so that a call failing its schema can be written again.

The parser (family_parser.py) asks it three things. `holds(name)`: a marker call of a tool
with a schema (ParserOptions.call_schemas) is held from its name until its JSON closes, since
a call whose arguments fail the schema must not have gone out as a call. `fails(name,
arguments)`: the arguments are a JSON object that tool's schema refuses (text that is not a
JSON object is another failure, kept as before: a call with "invalid_json" / "bad_arguments").
`invalid_call(...)`: such a call as a ToolCallInvalid for the core to repair, carrying the
output before it and the family's opening of the call (argosy/core/tool_repair.py); the
parser asks for it only with `can_repair`, else the call is sent back as its text.

Invariant: `num_fed` counts every character fed to the parser; with `can_repair`, `_fed`
joins to exactly that input (the only case where it is kept: a repair needs the prefix).
"""

from __future__ import annotations

from argosy.chat.call_check import fails_schema
from argosy.chat.events import ToolCallInvalid
from argosy.chat.families.base import CallSyntax
from argosy.chat.parser_options import ParserOptions


class CallGuard:
    def __init__(self, options: ParserOptions, syntax: CallSyntax, choice_index: int) -> None:
        is_checked = options.has_tool_calls and not options.is_call_forced
        self._schemas = (options.call_schemas or {}) if is_checked else {}
        self.can_repair = options.can_repair_calls
        self._syntax = syntax
        self._choice_index = choice_index
        self._fed: list[str] | None = [] if self.can_repair else None
        self.num_fed = 0

    def feed(self, delta: str) -> None:
        self.num_fed += len(delta)
        if self._fed is not None:
            self._fed.append(delta)

    def holds(self, name: str) -> bool:
        """A call of `name` is held until its arguments are checked: its tool has a schema."""
        return self._schemas.get(name) is not None

    def fails(self, name: str, arguments: str) -> bool:
        return fails_schema(arguments, self._schemas.get(name))

    def invalid_call(
        self, call_index: int, name: str, arguments: str, *, text: str, start: int, is_marked: bool
    ) -> ToolCallInvalid:
        """The call whose raw `text` began at input position `start`, for the core to decide."""
        assert self._fed is not None, "a call is handed over for repair only with can_repair"
        fed = "".join(self._fed)
        self._fed = [fed]
        opening = self._syntax.call_opening(name, is_marked=is_marked)
        return ToolCallInvalid(self._choice_index, call_index, name, arguments, text, fed[:start], opening)
