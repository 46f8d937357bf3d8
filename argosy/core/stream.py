"""CoreStream: the events of one generation, all its choices interleaved.

`Core.start()` (core.py) checks a CoreRequest and returns a CoreStream; the stream is an
async context manager whose exit (normal, error, client gone, task cancelled) aborts whatever
is still running in the engine. `collect()` drains one into a result per choice for
non-streaming responses.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from argosy.chat.collector import ChannelCollector
from argosy.chat.events import (
    Event,
    Finish,
    LogprobsDelta,
    PromptEcho,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallStart,
    ToolParseFailure,
    Usage,
)
from argosy.core.access_log import GenerationTiming, access_log, format_line
from argosy.core.admission import Ticket
from argosy.core.channels import ChannelSpec
from argosy.core.choice import ChoiceState
from argosy.core.recording import GenerationRecord, SessionSpec
from argosy.core.tool_repair import TOOL_CALL_INVALID, ToolCallRepairs
from argosy.engine.arrivals import Arrival
from argosy.engine.outputs import RequestOutput
from argosy.engine.sequence import ImagePlacement
from argosy.errors import ArgosyError
from argosy.runner.structured import GuideSpec
from argosy.sampling_params import RequestSampling

if TYPE_CHECKING:
    from argosy.core.engine_client import EngineClient

log = logging.getLogger("argosy.api")

# Named in `degraded` when a choice's tool call came back as text (ToolParseFailure.
# is_call_left_as_text): the tools were offered, but that call could not be honoured as one;
# `tool_call_invalid` (TOOL_CALL_INVALID) instead when it parsed but failed its tool's schema.
TOOL_CALL_UNPARSED = "tool_call_unparsed"


@dataclass(slots=True)
class CoreRequest:
    """One generation, dialect-free. Choice `p * n + j` is the j-th sample of prompt p."""

    prompts: list[list[int]]
    sampling: RequestSampling
    n: int = 1
    echo: bool = False  # emit each prompt back (PromptEcho), with its logprobs when asked
    qos: str = "interactive"
    batch_invariant: bool = False  # tokens equal a solo run (SamplingParams.batch_invariant)
    session: SessionSpec | None = None  # what its session records; None: the raw prompts
    route: str = "-"  # for the access log, e.g. "POST /v1/completions"
    request_id: str = "-"  # the HTTP request's x-request-id, for the access log
    prompt_param: str = "prompt"  # the client field a prompt-sized error names
    channels: ChannelSpec | None = None  # chat: split each choice's text into channels
    guide: GuideSpec | None = None  # the grammar every choice follows (a guide each)
    arrival: Arrival | None = None  # counted as arriving at the engine until it is queued
    arrival_time: float = field(default_factory=time.perf_counter)
    adapter: str | None = None  # the LoRA adapter it runs with (SamplingParams.lora)
    adapter_scale: float = 1.0
    # llama.cpp's per-request `lora: [{id, scale}]`, resolved against the model's adapters
    lora_ids: list[tuple[int, float]] | None = None
    images: list[ImagePlacement] | None = None  # a VLM prompt's images (one prompt; core/vision.py)


@dataclass(slots=True)
class CollectedChoice:
    """A finished choice, as `collect()` accumulates it for non-streaming responses."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    echo: PromptEcho | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    channels: ChannelCollector = field(default_factory=ChannelCollector)  # chat: the message


class _Heartbeat(Exception):
    """No engine output for the heartbeat's interval (internal to CoreStream)."""


class CoreStream:
    """The events of one CoreRequest, all choices interleaved.

    Use as `async with core.start(req) as stream: async for event in stream: ...`. Each
    choice runs as its own engine request, pumped by its own task into one queue; leaving
    the block cancels the tasks, which closes their engine generators and so aborts those
    requests in the engine. `usage` is the whole request's so far: each prompt counted
    once whatever n is, completion tokens over all choices.

    Admission: the stream holds its `ticket` until its first engine output (or its end).
    Slow readers: past `max_buffered` outputs waiting unread, a choice's engine request is
    stopped and it finishes "length" once the reader reaches the cut (`slow_reader`).
    Time limit: past `timeout_s` from arrival the engine requests are stopped and every
    unfinished choice finishes "length"; `degraded` then names "request_timeout" (dialects
    put it in x-argosy-degraded, or in a stream's trailing comment); a tool call that came
    back as text names "tool_call_unparsed" there ("tool_call_invalid" for a call that parsed
    but failed its schema). Repairs: such a call is first written again under its schema's
    grammar while the request's budget lasts (`repairs`, argosy/core/tool_repair.py), the
    choice's events waiting for it. Sessions: `record` sees
    every event and commits them when the stream ends (`record.committed`). Shutdown: past
    the drain's grace, `abort(error)` ends it from outside with `error` (argosy/core/drain.py).
    """

    def __init__(
        self,
        engine: EngineClient,
        request: CoreRequest,
        choices: list[ChoiceState],
        model_id: str,
        stream_id: str,
        *,
        ticket: Ticket | None = None,
        record: GenerationRecord | None = None,
        timeout_s: float | None = None,
        max_buffered: int | None = None,
    ) -> None:
        self.request = request
        self.record = record
        self.degraded: list[str] = []
        self._ticket = ticket
        self._deadline = None if timeout_s is None else request.arrival_time + timeout_s
        self.choices = choices
        self.model_id = model_id
        self.id = stream_id
        self.timing = GenerationTiming(request.arrival_time)
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._is_started = False
        self.on_close: list[Callable[[], None]] = []  # called once as the stream ends
        self._max_buffered = max_buffered  # engine outputs waiting unread, then the cut
        self._abort_error: ArgosyError | None = None  # set by abort(): raised to the reader
        channels = request.channels
        self.repairs = (
            ToolCallRepairs(engine, channels, stream_id=stream_id, qos=request.qos, deadline=self._deadline)
            if channels is not None and channels.options.can_repair_calls  # budget 0: resolved as text
            else None
        )

    def effective_sampling(self) -> dict[str, Any]:
        """The sampling the engine runs (SamplingParams.effective of the first choice, after
        precedence, the drawn seed included); with more than one choice, `seeds` lists every
        choice's seed in choice order (the other knobs are every choice's, but for max_tokens left
        to the room in the context, which is the first prompt's in a batch of prompts)."""
        if not self.choices:
            return {}
        sampling: dict[str, Any] = self.choices[0].params.effective()
        if len(self.choices) > 1:
            sampling["seeds"] = [choice.params.seed for choice in self.choices]
        return sampling

    @property
    def usage(self) -> Usage:
        total = Usage()
        by_prompt: dict[int, list[ChoiceState]] = {}
        for choice in self.choices:
            by_prompt.setdefault(choice.prompt_index, []).append(choice)
            total.completion_tokens += choice.usage.completion_tokens
            if choice.usage.spec_proposed_tokens is not None:
                total.spec_proposed_tokens = (
                    total.spec_proposed_tokens or 0
                ) + choice.usage.spec_proposed_tokens
                total.spec_accepted_tokens = (total.spec_accepted_tokens or 0) + (
                    choice.usage.spec_accepted_tokens or 0
                )
        for group in by_prompt.values():
            total.prompt_tokens += group[0].usage.prompt_tokens
            # The prompt is counted once, so is its cache hit: the least any sample reused.
            reported = [c.usage.cached_tokens for c in group if c.has_output]
            total.cached_tokens += min(reported) if reported else 0
        return total

    async def __aenter__(self) -> CoreStream:
        for choice in self.choices:
            task = asyncio.create_task(self._pump(choice), name=f"{self.id}-{choice.index}")
            self._tasks.append(task)
        if self.record is not None:
            self.record.open()
        self._is_started = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Synchronous on purpose: under a cancelled scope any await here could be cancelled.
        for task in self._tasks:
            task.cancel()
        self.close()
        finish = ",".join(c.finish_reason or "abort" for c in self.choices)
        if exc is not None and not isinstance(exc, asyncio.CancelledError | GeneratorExit):
            finish = "error"
        if self.record is not None:
            self.record.commit("error" if finish == "error" else "abort", [c.usage for c in self.choices])
        line = format_line(self.request.route, self.model_id, self.usage, self.timing, finish)
        access_log.info("%s request_id=%s", line, self.request.request_id)

    def close(self) -> None:
        """Give back what the stream holds (its admission place, its arrival count, the
        callbacks in `on_close`: the model lease). Idempotent; `__aexit__` calls it, and so
        does the HTTP response of a stream that was never entered (a client gone early)."""
        for task in self._tasks:
            task.cancel()
        if self._ticket is not None:
            self._ticket.release()
        if self.request.arrival is not None:
            self.request.arrival.done()
        callbacks, self.on_close = self.on_close, []
        for on_close in callbacks:
            on_close()

    @property
    def is_aborted(self) -> bool:
        return self._abort_error is not None

    def abort(self, error: ArgosyError) -> bool:
        """Stop the generation from outside (the server's shutdown grace ran out): its engine
        requests are cancelled and the reader's next step raises `error`, ahead of any output
        still buffered, so the dialect ends the response in error (a stream: one framed error
        event) and the record commits what was read with the finish "error". False when it
        was aborted already."""
        if self._abort_error is not None:
            return False
        self._abort_error = copy.copy(error)  # each reader raises its own
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait((0, self._abort_error))  # wakes a reader waiting for output
        return True

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events(None)  # type: ignore[return-value]  # no heartbeat: never None

    def with_heartbeats(self, every_s: float) -> AsyncGenerator[Event | None, None]:
        """The events, with a None in between whenever none came for `every_s` seconds (a
        dialect's keep-alive: Anthropic's `ping`). The wait is the stream's own queue wait
        under a timer, armed only when no output is waiting: no task per event."""
        return self._events(every_s)

    async def _events(self, heartbeat_s: float | None) -> AsyncGenerator[Event | None, None]:
        if not self._is_started:
            raise RuntimeError("iterate a CoreStream inside `async with`")
        num_unfinished = len(self.choices)
        while num_unfinished:
            if self._abort_error is not None:
                raise self._abort_error
            try:
                index, item = await self._next_output(heartbeat_s)
            except _Heartbeat:
                yield None
                continue
            except TimeoutError:
                for choice, events in self._time_out():
                    for event in await self._resolved(choice, events):
                        self._observe(event)
                        yield event
                return
            if self._ticket is not None:
                self._ticket.started()
            if self.record is not None and isinstance(item, RequestOutput):
                self.record.add_token_ids(index, item.new_token_ids)
            if isinstance(item, ArgosyError):
                raise item
            if isinstance(item, BaseException):
                raise ArgosyError(f"Generation failed: {type(item).__name__}: {item}") from item
            choice = self.choices[index]
            self.timing.stamp(index, item.num_output_tokens)
            if self.timing.queue_s is None:
                self.timing.queue_s = item.queue_s
            for event in await self._resolved(choice, choice.on_output(item)):
                self._observe(event)
                yield event
            if item.finished:
                num_unfinished -= 1

    async def _resolved(self, choice: ChoiceState, events: list[Event]) -> list[Event]:
        """A choice's events with its calls that failed their schemas resolved (repaired, or
        text): no ToolCallInvalid leaves the core."""
        if self.repairs is None or not self.repairs.needs(choice.index, events):
            return events
        return await self.repairs.process(choice, events)

    async def _next_output(self, heartbeat_s: float | None) -> tuple[int, RequestOutput | BaseException]:
        """The next engine output; TimeoutError past the request's deadline, _Heartbeat when
        `heartbeat_s` passed without one (the deadline wins when both are due)."""
        remaining_s = None if self._deadline is None else self._deadline - time.perf_counter()
        if remaining_s is not None and remaining_s <= 0:
            raise TimeoutError
        if not self._queue.empty():  # the common case under load: no timer needed
            return self._queue.get_nowait()
        if remaining_s is None and heartbeat_s is None:
            return await self._queue.get()
        is_beat = heartbeat_s is not None and (remaining_s is None or heartbeat_s < remaining_s)
        wait_s = heartbeat_s if is_beat else remaining_s
        try:
            # asyncio.timeout, not wait_for: no task per wait (a cancelled Queue.get loses nothing)
            async with asyncio.timeout(wait_s):
                return await self._queue.get()
        except TimeoutError:
            if is_beat:
                raise _Heartbeat from None
            raise

    def _time_out(self) -> list[tuple[ChoiceState, list[Event]]]:
        """The wall-clock limit passed: stop the engine requests and finish every unfinished
        choice with "length" (through its own on_output, so it ends as any choice ends)."""
        log.warning("%s: request timeout; stopping it (finish_reason length)", self.request.request_id)
        self.degraded.append("request_timeout")
        for task in self._tasks:
            task.cancel()
        events: list[tuple[ChoiceState, list[Event]]] = []
        for choice in self.choices:
            if choice.finish_reason is not None:
                continue
            last = RequestOutput(
                request_id=f"{self.id}-{choice.index}",
                new_token_ids=[],
                num_prompt_tokens=len(choice.prompt_ids),
                num_cached_tokens=choice.usage.cached_tokens,
                num_output_tokens=choice.usage.completion_tokens,
                finished=True,
                finish_reason="length",
            )
            events.append((choice, choice.on_output(last)))
        return events

    def _is_over_buffer(self) -> bool:
        return self._max_buffered is not None and self._queue.qsize() >= self._max_buffered

    def _cut_slow_reader(self, choice: ChoiceState, last: RequestOutput) -> None:
        """The client reads slower than the engine writes and `max_buffered` outputs wait
        unread: stop this choice's engine request and finish it "length" after what is
        buffered (named `slow_reader` in the degraded fields), so one slow client holds
        neither memory nor engine time."""
        log.warning(
            "%s: the client reads too slowly; stopping choice %d", self.request.request_id, choice.index
        )
        if "slow_reader" not in self.degraded:
            self.degraded.append("slow_reader")
        cut = RequestOutput(
            request_id=last.request_id,
            new_token_ids=[],
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            num_output_tokens=last.num_output_tokens,
            finished=True,
            finish_reason="length",
            num_spec_proposed=last.num_spec_proposed,
            num_spec_accepted=last.num_spec_accepted,
        )
        self._queue.put_nowait((choice.index, cut))

    def _observe(self, event: Event) -> None:
        if self.record is not None:
            self.record.add(event)
        if isinstance(event, ToolParseFailure) and event.is_call_left_as_text:
            name = TOOL_CALL_INVALID if event.is_invalid_call else TOOL_CALL_UNPARSED
            if name not in self.degraded:
                self.degraded.append(name)

    async def _pump(self, choice: ChoiceState) -> None:
        outputs = self._engine.generate(
            choice.prompt_ids,
            choice.params,
            request_id=f"{self.id}-{choice.index}",
            qos=self.request.qos,
            guide=self.request.guide,
            arrival=self.request.arrival,
            affinity=self.request.session.affinity() if self.request.session is not None else (),
            **({"images": self.request.images} if self.request.images else {}),
        )
        try:
            async for out in outputs:
                self._queue.put_nowait((choice.index, out))
                if not out.finished and self._is_over_buffer():
                    self._cut_slow_reader(choice, out)
                    return  # leaving closes the engine generator: the request is aborted
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait((choice.index, exc))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]


async def collect(stream: CoreStream) -> list[CollectedChoice]:
    """Drain a started stream into one result per choice (non-streaming responses)."""
    wants_logprobs = [c.params.logprobs is not None for c in stream.choices]
    results = [
        CollectedChoice(index=i, logprobs=[] if wants_logprobs[i] else None)
        for i in range(len(stream.choices))
    ]
    async for event in stream:
        result = results[event.index]
        if isinstance(event, PromptEcho):
            result.echo = event
        elif isinstance(event, TextDelta):
            result.text += event.text
            result.channels.add((event,))
            if event.logprobs and result.logprobs is not None:
                result.logprobs.extend(event.logprobs)
        elif isinstance(event, ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolParseFailure):
            result.channels.add((event,))
        elif isinstance(event, LogprobsDelta):
            if result.logprobs is not None:
                result.logprobs.extend(event.logprobs)
        elif isinstance(event, Finish):
            result.finish_reason = event.reason
            result.stop_reason = event.stop_reason
    return results
