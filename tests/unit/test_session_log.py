"""ChoiceLog and the conversation helpers: what a generation records, and how a stored
conversation becomes the next prompt."""

from __future__ import annotations

from argosy.chat.events import (
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    TokenCandidate,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolParseFailure,
    Usage,
)
from argosy.chat.messages import Message, ToolCallRecord
from argosy.core.conversation import (
    chat_message,
    chat_message_events,
    continued_prompt,
    generated_token_ids,
    history_messages,
)
from argosy.core.session_log import ChoiceLog, logprob_record, logprobs_of
from argosy.sessions.events import (
    Finished,
    MessageAppended,
    SpanGenerated,
    ToolParseFailed,
    ToolUsed,
    decode_event,
    encode_event,
)
from argosy.sessions.store import StoredEvent


def test_spans_per_channel_run_and_every_token_id_in_exactly_one_span() -> None:
    log = ChoiceLog()
    steps = [
        ([1, 2], [ReasoningDelta(0, "hm")]),
        ([3], []),  # held back: goes with the next event
        ([4], [TextDelta(0, "Hi"), TextDelta(0, " there")]),
        ([5], [LogprobsDelta(0, [])]),  # carries nothing to record
        ([6, 7], [ToolCallStart(0, 0, "c1", "f"), ToolCallArgsDelta(0, 0, "{}"), ToolCallEnd(0, 0)]),
        ([8], [ToolParseFailure(0, "<tool_call>{", "invalid_json")]),
        ([9], [TextDelta(0, "!")]),
        ([2], [Finish(0, "stop", Usage(5, 9, 3))]),  # the EOS: no text, joins the last span
    ]
    for token_ids, events in steps:
        log.add_token_ids(token_ids)
        for event in events:
            log.add(event)
    assert log.events() == [
        SpanGenerated("reasoning", "hm", [1, 2]),
        SpanGenerated("text", "Hi there", [3, 4]),
        SpanGenerated("tool_call", "{}", [5, 6, 7]),
        ToolUsed("c1", "f", "{}"),
        ToolParseFailed("<tool_call>{", "invalid_json"),
        SpanGenerated("text", "!", [8, 9, 2]),
        Finished("stop", {"prompt_tokens": 5, "completion_tokens": 9, "cached_tokens": 3}),
    ]


def test_an_unfinished_choice_ends_with_the_given_reason_and_keeps_its_ids() -> None:
    log = ChoiceLog()
    log.add_token_ids([7, 8])
    assert log.events("abort") == [SpanGenerated("text", "", [7, 8]), Finished("abort")]


def lp(token_id: int, token_bytes: bytes, text: str) -> TokenLogprobs:
    """An entry whose chosen token is also its one alternative."""
    chosen = TokenCandidate(token_id, token_bytes.decode("utf-8", "replace"), token_bytes, -0.5)
    return TokenLogprobs(chosen, text, [chosen])


def test_text_spans_keep_their_tokens_logprobs_when_asked() -> None:
    think, hi, eos = lp(1, b"<think>", "<think>"), lp(2, b"Hi", "Hi"), lp(3, b"<|im_end|>", "")
    events = [
        LogprobsDelta(0, [think]),
        ReasoningDelta(0, "hm"),
        LogprobsDelta(0, [hi]),
        TextDelta(0, "Hi"),
        LogprobsDelta(0, [eos]),  # the EOS: no event follows, it joins the last span
        Finish(0, "stop", Usage(5, 3, 0)),
    ]
    kept, plain = ChoiceLog(keeps_logprobs=True), ChoiceLog()
    for event in events:
        kept.add(event)
        plain.add(event)
    reasoning, text, _ = kept.events()
    assert reasoning == SpanGenerated("reasoning", "hm")  # only text spans keep theirs
    assert isinstance(text, SpanGenerated) and text.logprobs is not None
    assert logprobs_of(text.logprobs) == [hi, eos]
    assert plain.events()[:2] == [SpanGenerated("reasoning", "hm"), SpanGenerated("text", "Hi")]


def test_a_span_with_logprobs_round_trips_through_its_payload() -> None:
    masked = TokenCandidate(4, "\ufffd", b"\xe2", float("-inf"))  # half a character, masked out
    entry = TokenLogprobs(masked, "", [lp(2, b"Hi", "Hi").chosen, masked])
    span = SpanGenerated("text", "", [4], [logprob_record(entry)])
    kind, payload = encode_event(span)
    decoded = decode_event(kind, payload)
    assert decoded == span and logprobs_of(decoded.logprobs or []) == [entry]  # type: ignore[union-attr]
    assert encode_event(SpanGenerated("text", "x", [1]))[1] == '{"channel":"text","text":"x","token_ids":[1]}'


def test_history_is_messages_and_one_assistant_message_per_generated_turn() -> None:
    stored = [
        StoredEvent(1, 0.0, MessageAppended("system", "Be brief."), "a"),
        StoredEvent(2, 0.0, MessageAppended("user", "Hi"), "a"),
        StoredEvent(3, 0.0, SpanGenerated("reasoning", "greet", [1]), "a"),
        StoredEvent(4, 0.0, SpanGenerated("text", "Hello", [2, 3]), "a"),
        StoredEvent(5, 0.0, SpanGenerated("tool_call", "{}", [4]), "a"),
        StoredEvent(6, 0.0, ToolUsed("c1", "f", "{}"), "a"),
        StoredEvent(7, 0.0, Finished("tool_calls"), "a"),
        StoredEvent(8, 0.0, MessageAppended("tool", "42", tool_call_id="c1"), "b"),
        StoredEvent(9, 0.0, MessageAppended("user", "And?"), "b"),
        StoredEvent(10, 0.0, Finished("abort"), "b"),  # cancelled before any output: no answer
    ]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert history_messages(stored) == [
        MessageAppended("system", "Be brief."),
        MessageAppended("user", "Hi"),
        MessageAppended("assistant", "Hello", tool_calls=calls, reasoning="greet"),
        MessageAppended("tool", "42", tool_call_id="c1"),
        MessageAppended("user", "And?"),
    ]
    assert generated_token_ids(stored, after_seq=2) == [1, 2, 3, 4]
    assert chat_message(history_messages(stored)[2]) == Message(
        "assistant", "Hello", reasoning="greet", tool_calls=[ToolCallRecord("f", "{}", "c1")]
    )
    assert chat_message(MessageAppended("developer", [{"type": "text", "text": "x"}])) == Message(
        "system", "x"
    )


def test_chat_messages_are_recorded_with_their_extras() -> None:
    class Wire:  # what openai_chat's pydantic ChatMessage offers
        def __init__(self, role: str, content: str | None, **extra: object) -> None:
            self.role, self.content, self.name, self.model_extra = role, content, None, extra

    events = chat_message_events([Wire("user", "Hi"), Wire("tool", "42", tool_call_id="c1")])
    assert events == [MessageAppended("user", "Hi"), MessageAppended("tool", "42", tool_call_id="c1")]


def test_a_continued_prompt_extends_the_first_candidate_whose_text_is_a_prefix() -> None:
    vocabulary = {1: "<s>", 2: "Hi", 3: "!", 4: " more"}
    decode = lambda ids: "".join(vocabulary[i] for i in ids)  # noqa: E731
    encode = lambda text: [99] * len(text)  # noqa: E731 - stands in for the tokenizer
    assert continued_prompt([[1, 2, 3], [1, 2]], "<s>Hi! more", decode, encode) == (0, [1, 2, 3] + [99] * 5)
    assert continued_prompt([[1, 2, 4], [1, 2]], "<s>Hi! more", decode, encode) == (1, [1, 2] + [99] * 6)
    assert continued_prompt([[1, 3]], "<s>Hi", decode, encode) is None
    assert continued_prompt([[1, 2]], "<s>Hi", decode, encode) is None  # nothing new to add
    assert continued_prompt([[]], "<s>Hi", decode, encode) is None
