"""ToolCallRepairs: the core's half of the tool-call guardrail.

In `auto` mode a call that parses (a declared tool, arguments a JSON object) but whose
arguments fail that tool's JSON schema reaches the core as a ToolCallInvalid: the parser held
it instead of sending it (argosy/chat/call_guard.py, for marker calls and bare JSON alike).
While the request's repair budget lasts it is written again, once: a new engine request whose
prompt is the choice's prompt, the output before the call and the call's opening up to its
arguments (`<tool_call>\\n{"name": "f", "arguments": `), with the arguments held by a grammar
of the tool's schema (a strict json_schema GrammarSpec, compiled where the engine runs, as a
forced call's is). Arguments that then pass the schema become that call (ToolCallStart,
ToolCallArgsDelta, ToolCallEnd). Otherwise (no budget left, or 0; the schema not compilable;
the prompt past the context; the repair cut short or still failing) the call is its text,
with a ToolParseFailure "invalid_arguments", and the answer names `tool_call_invalid` in
x-argosy-degraded.

Budget: `--tool-repair-budget` (default 1), a request's `tool_repair_budget` over it; shared
by all the request's choices and calls, spent by each attempt. The default is on because a
repair costs one short constrained generation (the arguments only: tens of tokens) only when a
call already failed, and gives the client a call it can run instead of text it must parse.

Why the model writes again rather than the arguments being patched: it chooses the values
anew knowing what the schema allows (an enum's members, an integer's bounds), from the same
context. Order: the repair runs where its event stands in its choice's events (the choice's
later output keeps coming from the engine, buffered), so what followed the call follows it
still. Numbering: a call sent back as text leaves its number free and the choice's later calls
are numbered down, so a choice's calls stay 0, 1, 2...; a choice that made a call only by
repair finishes "tool_calls". The repair's tokens count in the choice's completion tokens; no
logprobs are reported for them (a choice's logprobs describe the output it generated first).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from argosy.chat.call_check import fits_schema
from argosy.chat.events import (
    INVALID_ARGUMENTS,
    Event,
    Finish,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallInvalid,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.errors import ArgosyError
from argosy.runner.structured import GrammarSpec, GuideSpec

if TYPE_CHECKING:
    from argosy.core.channels import ChannelSpec
    from argosy.core.choice import ChoiceState
    from argosy.core.engine_client import EngineClient
    from argosy.sampling_params import SamplingParams

log = logging.getLogger("argosy.api")

# Named in `degraded` when a call that parsed but failed its schema came back as text.
TOOL_CALL_INVALID = "tool_call_invalid"

_NUMBERED = (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)


@dataclass(slots=True)
class _ChoiceRepairs:
    num_freed: int = 0  # call numbers left free by calls sent back as text
    has_repaired: bool = False


class ToolCallRepairs:
    """One per CoreStream whose chat request may repair calls (ChannelSpec.repair_budget > 0).

    `process` takes a choice's events as ChoiceState.on_output made them and returns them with
    every ToolCallInvalid resolved (a call, or text and a failure) and the rest renumbered."""

    def __init__(
        self,
        engine: EngineClient,
        channels: ChannelSpec,
        *,
        stream_id: str,
        qos: str,
        deadline: float | None,
    ) -> None:
        self._engine = engine
        self._schemas = channels.options.call_schemas or {}
        self._new_call_id = channels.family.new_call_id
        self.budget = channels.repair_budget
        self._stream_id = stream_id
        self._qos = qos
        self._deadline = deadline  # time.perf_counter() past which nothing more is generated
        self._choices: dict[int, _ChoiceRepairs] = {}
        self._num_attempts = 0

    def needs(self, choice_index: int, events: list[Event]) -> bool:
        """Whether `events` must go through `process` (cheap: most outputs need nothing)."""
        return choice_index in self._choices or any(isinstance(event, ToolCallInvalid) for event in events)

    async def process(self, choice: ChoiceState, events: list[Event]) -> list[Event]:
        state = self._choices.setdefault(choice.index, _ChoiceRepairs())
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallInvalid):
                out.extend(await self._resolve(choice, state, event))
            elif isinstance(event, Finish):
                usage = dataclasses.replace(event.usage, completion_tokens=choice.usage.completion_tokens)
                reason = "tool_calls" if state.has_repaired and event.reason == "stop" else event.reason
                if reason != event.reason:
                    choice.finish_reason = reason
                out.append(dataclasses.replace(event, reason=reason, usage=usage))
            else:
                out.append(_renumbered(event, state.num_freed))
        return out

    async def _resolve(
        self, choice: ChoiceState, state: _ChoiceRepairs, invalid: ToolCallInvalid
    ) -> list[Event]:
        index, call_index = invalid.index, invalid.call_index - state.num_freed
        arguments = None
        if self.budget > 0:
            self.budget -= 1
            arguments = await self._repair(choice, invalid)
        if arguments is None:
            state.num_freed += 1
            return [TextDelta(index, invalid.text), ToolParseFailure(index, invalid.text, INVALID_ARGUMENTS)]
        state.has_repaired = True
        return [
            ToolCallStart(index, call_index, self._new_call_id(), invalid.name),
            ToolCallArgsDelta(index, call_index, arguments),
            ToolCallEnd(index, call_index),
        ]

    async def _repair(self, choice: ChoiceState, invalid: ToolCallInvalid) -> str | None:
        """The call's arguments written again under its schema's grammar; None if that fails."""
        schema = self._schemas.get(invalid.name)
        if schema is None:
            return None
        description = self._engine.description
        continuation = invalid.prefix + invalid.opening
        prompt = choice.prompt_ids + description.tokenizer.encode(continuation, add_special_tokens=False).ids
        room = description.context_length - len(prompt)
        if room < 1:
            log.info("%s: no room in the context to repair the call of %s", self._stream_id, invalid.name)
            return None
        params = dataclasses.replace(
            choice.params,
            max_tokens=room if choice.params.max_tokens is None else min(choice.params.max_tokens, room),
            stop=[],
            include_stop_str_in_output=False,
            logprobs=None,
            prompt_logprobs=None,
            skip_special_tokens=True,
        )
        grammar = GrammarSpec("json_schema", schema, strict=True)
        self._num_attempts += 1
        request_id = f"{self._stream_id}-{choice.index}-repair{self._num_attempts}"
        try:
            self._engine.validate(prompt, params, self._qos)
            await self._engine.compile_grammar(grammar, "tools")
        except ArgosyError as exc:
            log.info("%s: the call of %s cannot be repaired: %s", self._stream_id, invalid.name, exc.message)
            return None
        text, finish_reason = await self._generate(choice, prompt, params, GuideSpec(grammar), request_id)
        is_repaired = finish_reason == "stop" and fits_schema(text, schema)
        log.info(
            "%s: call of %s %s (finish %s): %.200r -> %.200r",
            self._stream_id,
            invalid.name,
            "repaired" if is_repaired else "not repaired",
            finish_reason,
            invalid.arguments,
            text,
        )
        return text if is_repaired else None

    async def _generate(
        self,
        choice: ChoiceState,
        prompt: list[int],
        params: SamplingParams,
        guide: GuideSpec,
        request_id: str,
    ) -> tuple[str, str]:
        """The repair's text and how it ended ("stop": its grammar complete; "timeout" past
        the request's deadline); its tokens are counted in `choice`'s usage."""
        remaining_s = None if self._deadline is None else self._deadline - time.perf_counter()
        parts: list[str] = []
        num_tokens, finish_reason = 0, "abort"
        outputs = self._engine.generate(prompt, params, request_id, qos=self._qos, guide=guide)
        try:
            async with asyncio.timeout(remaining_s):
                async for out in outputs:
                    parts.append(out.text_delta)
                    num_tokens, finish_reason = out.num_output_tokens, out.finish_reason or finish_reason
        except TimeoutError:
            finish_reason = "timeout"
        except ArgosyError as exc:  # the engine refused it: the call stays text, the answer goes on
            log.warning("%s: the repair failed: %s", request_id, exc.message)
            finish_reason = "error"
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            choice.add_repair_tokens(num_tokens)
        return "".join(parts), finish_reason


def _renumbered(event: Event, num_freed: int) -> Event:
    """`event` with its call number moved down past the numbers calls sent back as text freed."""
    if not num_freed:
        return event
    if isinstance(event, _NUMBERED) or (isinstance(event, ToolParseFailure) and event.call_index is not None):
        assert event.call_index is not None
        return dataclasses.replace(event, call_index=event.call_index - num_freed)
    return event
