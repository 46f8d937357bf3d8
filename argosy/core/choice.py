"""One choice of a generation: engine outputs in, neutral events out.

Per choice the core keeps a ChoiceState: it emits the prompt echo (with prompt logprobs)
first, text deltas with their logprobs aligned to the text (LogprobAligner), and the
finish with this choice's usage. A chat choice's events then go through its channel stage
(argosy/core/channels.py): text, reasoning and tool calls, logprobs apart.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

from argosy.chat.events import Event, Finish, PromptEcho, TextDelta, TokenCandidate, TokenLogprobs, Usage
from argosy.core.token_text import TokenTexts
from argosy.engine.detokenizer import IncrementalDetokenizer
from argosy.engine.outputs import RequestOutput, TokenLogprob
from argosy.errors import ArgosyError
from argosy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from argosy.core.channels import ChoiceChannels


class ChoiceState:
    """Per choice: turns engine outputs into events (echo, aligned logprobs, finish)."""

    def __init__(
        self,
        *,
        index: int,
        prompt_index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        echo: bool,
        tokenizer: Tokenizer,
        token_texts: TokenTexts,
        channels: ChoiceChannels | None = None,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.params = params
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self.has_output = False
        self.output_ids: list[int] = []  # every token generated so far
        self.num_repair_tokens = 0  # generated to repair its tool calls (core/tool_repair.py)
        self._needs_echo = echo
        self._channels = channels
        self._tokenizer = tokenizer
        self._texts = token_texts
        self._aligner = (
            LogprobAligner(tokenizer, token_texts, prompt_ids, params.skip_special_tokens)
            if params.logprobs is not None
            else None
        )

    def on_output(self, out: RequestOutput) -> list[Event]:
        if out.error is not None or out.finish_reason == "error":
            raise ArgosyError(f"Generation failed: {out.error or 'engine error'}")
        self.has_output = True
        self.output_ids.extend(out.new_token_ids)
        self.usage.completion_tokens = out.num_output_tokens + self.num_repair_tokens
        self.usage.cached_tokens = out.num_cached_tokens
        self.usage.spec_proposed_tokens = out.num_spec_proposed
        self.usage.spec_accepted_tokens = out.num_spec_accepted
        events: list[Event] = []
        if self._needs_echo:
            self._needs_echo = False
            events.append(self._echo(out.prompt_logprobs))
        logprobs: list[TokenLogprobs] | None = None
        if self._aligner is not None:
            self._aligner.add(out.new_logprobs or [])
            logprobs = self._aligner.release(out.text_delta, is_finished=out.finished)
        if out.text_delta or logprobs:
            events.append(TextDelta(self.index, out.text_delta, logprobs))
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            events.append(
                Finish(self.index, self.finish_reason, dataclasses.replace(self.usage), out.stop_reason)
            )
        if self._channels is not None:
            events = self._channels.process(events)
            if out.finished:  # the channels may say "tool_calls", or "length" for a call cut off
                self.finish_reason = next(e.reason for e in events if isinstance(e, Finish))
        return events

    def add_repair_tokens(self, num_tokens: int) -> None:
        """Tokens a repair of one of its calls generated: counted as its completion tokens."""
        self.num_repair_tokens += num_tokens
        self.usage.completion_tokens += num_tokens

    def _echo(self, prompt_logprobs: list[TokenLogprob | None] | None) -> PromptEcho:
        pieces = token_pieces(self._tokenizer, [], self.prompt_ids, skip_special_tokens=False)
        text = "".join(pieces)
        if self.params.prompt_logprobs is None:
            return PromptEcho(self.index, text)
        engine_lps: list[TokenLogprob | None] = list(prompt_logprobs or [])
        engine_lps += [None] * (len(self.prompt_ids) - len(engine_lps))
        entries: list[TokenLogprobs] = []
        for position, (token_id, piece) in enumerate(zip(self.prompt_ids, pieces, strict=True)):
            lp = engine_lps[position]
            if lp is None:  # the first token: nothing precedes it
                entries.append(TokenLogprobs(_candidate(self._texts, token_id, None), piece))
            else:
                entries.append(_entry(self._texts, lp, piece))
        return PromptEcho(self.index, text, entries)


def _candidate(texts: TokenTexts, token_id: int, logprob: float | None) -> TokenCandidate:
    return TokenCandidate(token_id, texts.text_of(token_id), texts.bytes_of(token_id), logprob)


def _entry(texts: TokenTexts, lp: TokenLogprob, text: str) -> TokenLogprobs:
    top = [_candidate(texts, token_id, logprob) for token_id, logprob in lp.top]
    return TokenLogprobs(_candidate(texts, lp.token_id, lp.logprob), text, top)


def token_pieces(
    tokenizer: Tokenizer, context_ids: list[int], token_ids: list[int], *, skip_special_tokens: bool
) -> list[str]:
    """Each token's share of the decoded text (what it adds once its character is whole)."""
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.feed([token_id]).text_delta for token_id in token_ids]
    if pieces:
        pieces[-1] += detokenizer.flush()
    return pieces


class LogprobAligner:
    """Releases a choice's logprob entries in step with its emitted text.

    Invariant: the `text` of the entries released so far joins to the emitted text minus
    `_uncovered` (its tail no released entry accounts for yet); at the finish `_uncovered` is
    empty. An entry waits while its token's text is still held back (a possible stop-string
    start), and a token past a stop string gets '' — so the entries account for the text
    exactly.
    """

    def __init__(
        self, tokenizer: Tokenizer, texts: TokenTexts, prompt_ids: list[int], skip_special: bool
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special)
        self._texts = texts
        self._pending: deque[tuple[TokenLogprob, str]] = deque()
        self._uncovered = ""

    def add(self, logprobs: list[TokenLogprob]) -> None:
        for lp in logprobs:
            self._pending.append((lp, self._detokenizer.feed([lp.token_id]).text_delta))

    def release(self, text_delta: str, *, is_finished: bool) -> list[TokenLogprobs]:
        self._uncovered += text_delta
        if is_finished and self._pending:
            lp, piece = self._pending[-1]
            self._pending[-1] = (lp, piece + self._detokenizer.flush())
        released: list[TokenLogprobs] = []
        while self._pending:
            lp, piece = self._pending[0]
            if len(piece) > len(self._uncovered) and not is_finished:
                break
            text, self._uncovered = self._uncovered[: len(piece)], self._uncovered[len(piece) :]
            released.append(_entry(self._texts, lp, text))
            self._pending.popleft()
        if is_finished and released and self._uncovered:
            last = released[-1]
            released[-1] = TokenLogprobs(last.chosen, last.text + self._uncovered, last.top)
            self._uncovered = ""
        return released
