"""The neutral stream events the core emits and every dialect renders.

One generation is one stream of these, tagged by choice `index` (prompt-major: choice
`p * n + j` is the j-th sample of prompt p). Per choice the order is: `PromptEcho` (only
when asked for), any number of deltas, then exactly one `Finish`. A chat request's text is
split into channels (argosy/chat/parsing.py): `TextDelta`, `ReasoningDelta` and tool calls
(`ToolCallStart`, `ToolCallArgsDelta`..., `ToolCallEnd`); the per-token logprobs of its output
then travel apart, as `LogprobsDelta`, since a token's text may land in any channel (or in
none: a marker). Dialects render the kinds they know and must treat the union as open.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenCandidate:
    """A token with its log-probability: `token` is its own text (U+FFFD where it holds only
    part of a UTF-8 character), `token_bytes` its exact bytes. `logprob` is None only for a
    prompt's first token, which nothing precedes."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float | None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: the chosen token, its best alternatives, and `text`, the slice of the
    output text this token accounts for. Joining `text` over a choice's positions gives
    exactly that choice's text ('' for a token that only starts a character, a special
    token, or a token past a stop string)."""

    chosen: TokenCandidate
    text: str
    top: list[TokenCandidate] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # speculative decoding (None: the engine does not speculate): draft tokens verified / accepted
    spec_proposed_tokens: int | None = None
    spec_accepted_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class PromptEcho:
    """The prompt as text, first in its choice's stream (completions' `echo`). `logprobs` has
    one entry per prompt token (the first one's `chosen.logprob` is None: nothing precedes
    it), joining to `text`; None when not asked."""

    index: int
    text: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New output text; `logprobs` covers the tokens whose text is now fully emitted."""

    index: int
    text: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """The choice ended: `reason` is "stop", "length" (the budget ran out, or the output ended
    inside a tool call) or "tool_calls" (it made calls); `usage` is this choice's own."""

    index: int
    reason: str
    usage: Usage
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it


# Channel events: what argosy/chat/parsing.py splits generated text into. `index` is the
# choice, as above; `call_index` numbers one choice's tool calls 0, 1, 2... in order.


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """New reasoning text (the model's `<think>` channel)."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call opens: its name is known. Argument fragments and one `ToolCallEnd` follow."""

    index: int
    call_index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    """The next piece of a call's arguments JSON text; a call's pieces join to its arguments."""

    index: int
    call_index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    call_index: int


# The reason of a call whose arguments are a JSON object its tool's schema refuses.
INVALID_ARGUMENTS = "invalid_arguments"


@dataclass(frozen=True, slots=True)
class ToolParseFailure:
    """Something in the tool-call channel did not parse as a call (for logs; never dropped).

    `text` is the model's raw text of it. When `call_index` is set it still came back as that
    call (its name was known; its arguments may not be valid JSON); otherwise its text came back
    as content, except for `reason == "extra_call"` (a call past the first when parallel calls
    are off), which is left out. `is_unterminated`: the output ended inside the call (cut off,
    e.g. by max_tokens: the caller reports finish reason "length").
    """

    index: int
    text: str
    reason: str
    call_index: int | None = None
    is_unterminated: bool = False

    @property
    def is_call_left_as_text(self) -> bool:
        """A call attempt that came back as content (an undeclared tool, arguments that fail
        the schema, broken JSON...): the answer names it degraded, `tool_call_invalid` when
        it is `is_invalid_call`, else `tool_call_unparsed`."""
        return self.call_index is None and self.reason not in ("extra_call", "unexpected_text")

    @property
    def is_invalid_call(self) -> bool:
        """A call that parsed (a declared tool, arguments a JSON object) but whose arguments
        fail that tool's schema, come back as content."""
        return self.call_index is None and self.reason == INVALID_ARGUMENTS


@dataclass(frozen=True, slots=True)
class ToolCallInvalid:
    """A call that parsed (a declared tool, arguments a JSON object) but whose arguments fail
    that tool's schema, held for the core to decide (argosy/core/tool_repair.py): written
    again under a grammar of the schema (then it is call `call_index`: ToolCallStart,
    ToolCallArgsDelta, ToolCallEnd), or sent as content, `text`, with a ToolParseFailure
    "invalid_arguments". A parser emits it only when asked to (ParserOptions.can_repair_calls)
    and the core resolves every one, so no dialect ever sees it.

    `prefix` is the output before the call and `opening` the call's opening in the family's
    syntax up to its arguments (`<tool_call>\n{"name": "f", "arguments": `): the repair
    continues the prompt with both, so the model writes the arguments again, constrained.
    """

    index: int
    call_index: int
    name: str
    arguments: str  # the model's own JSON text of the arguments
    text: str  # the call's raw text, markers included
    prefix: str
    opening: str


ChannelEvent = (
    TextDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolCallArgsDelta
    | ToolCallEnd
    | ToolParseFailure
    | ToolCallInvalid
)


@dataclass(frozen=True, slots=True)
class LogprobsDelta:
    """Logprobs of the next generated tokens, in order, for a choice whose text is split into
    channels (its TextDeltas carry none). Over a choice they cover every generated token once."""

    index: int
    logprobs: list[TokenLogprobs]


Event = PromptEcho | ChannelEvent | LogprobsDelta | Finish
