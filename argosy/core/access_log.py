"""One access-log line per generation (logger `argosy.access`).

    POST /v1/chat/completions model=smollm2 prompt=37 cached=0 completion=8 ttft=61ms
    prefill=607 tok/s decode=31.2 tok/s total=290ms finish=stop

With speculative decoding on, ` spec=accepted/proposed` (draft tokens) ends the line.

The route carries the request's tags, as the reference's lines do: ` (fim)` for a
fill-in-the-middle request (its `model=` is the model that served it: a satellite, where the
requested model has one) and ` (stream)` for a streamed answer, in that order:

    POST /v1/completions (fim) (stream) model=qwen2.5-coder-0.5b prompt=31 ...

Rates measure what was actually done: prefill counts only the prompt tokens that were
computed (prompt - cached) over the time to first token; decode is the inter-token rate,
so the tokens that arrived with a choice's first output (and the time before it) are left
out. A rate with nothing to measure is "-".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from argosy.chat.events import Usage

access_log = logging.getLogger("argosy.access")


def tagged_route(route: str, tags: tuple[str, ...]) -> str:
    """`route` as the access log names it: each tag in parentheses after it."""
    return route + "".join(f" ({tag})" for tag in tags)


def prefill_rate(prompt_tokens: int, cached_tokens: int, ttft_s: float | None) -> str:
    prefilled = prompt_tokens - min(cached_tokens, prompt_tokens)
    if ttft_s is None or ttft_s <= 0 or prefilled <= 0:
        return "-"
    return f"{prefilled / ttft_s:.0f}"


def decode_rate(num_tokens: int, span_s: float | None) -> str:
    """Tokens per second between the first and the last delivery, or "-" when that cannot be
    a decode rate: no span, or (the reference's plausibility guard) more tokens than the span
    has milliseconds, i.e. past 1,000 tok/s: tokens delivered in a burst (a held-back tool call,
    an accepted draft, a stop string's holdback) rather than decoded one by one."""
    if span_s is None or span_s <= 0 or num_tokens <= 0 or int(span_s * 1000) < num_tokens:
        return "-"
    return f"{num_tokens / span_s:.1f}"


@dataclass(slots=True)
class _Span:
    first_time: float
    first_count: int
    last_time: float
    last_count: int


@dataclass(slots=True)
class GenerationTiming:
    """Clock of one generation: arrival, first output, and per choice the first and last
    output with the token count at each."""

    arrival_time: float
    first_output_time: float | None = None
    queue_s: float | None = None  # the first choice's wait in the engine's queue, as it said
    _spans: dict[int, _Span] = field(default_factory=dict)

    def stamp(self, index: int, num_output_tokens: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first_output_time is None:
            self.first_output_time = now
        span = self._spans.get(index)
        if span is None:
            self._spans[index] = _Span(now, num_output_tokens, now, num_output_tokens)
        else:
            span.last_time = now
            span.last_count = max(span.last_count, num_output_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_output_time is None else self.first_output_time - self.arrival_time

    def decode(self) -> tuple[int, float | None]:
        """(tokens after each choice's first output, the span they took, all choices together)."""
        spans = list(self._spans.values())
        if not spans:
            return 0, None
        num_tokens = sum(s.last_count - s.first_count for s in spans)
        span_s = max(s.last_time for s in spans) - min(s.first_time for s in spans)
        return num_tokens, span_s


def format_line(
    route: str,
    model: str,
    usage: Usage,
    timing: GenerationTiming,
    finish: str,
    now: float | None = None,
) -> str:
    now = time.perf_counter() if now is None else now
    ttft_s = timing.ttft_s
    decode_tokens, decode_span = timing.decode()
    ttft_ms = "-" if ttft_s is None else f"{ttft_s * 1000:.0f}"
    return (
        f"{route} model={model} prompt={usage.prompt_tokens} cached={usage.cached_tokens} "
        f"completion={usage.completion_tokens} ttft={ttft_ms}ms "
        f"prefill={prefill_rate(usage.prompt_tokens, usage.cached_tokens, ttft_s)} tok/s "
        f"decode={decode_rate(decode_tokens, decode_span)} tok/s "
        f"total={(now - timing.arrival_time) * 1000:.0f}ms finish={finish}"
        + (
            f" spec={usage.spec_accepted_tokens or 0}/{usage.spec_proposed_tokens}"
            if usage.spec_proposed_tokens is not None
            else ""
        )
    )
