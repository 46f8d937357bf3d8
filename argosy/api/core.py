"""The core: CoreRequest -> a stream of neutral events. The ONLY caller of the engine.

Dialects turn a request into a CoreRequest (prompt token ids, the sampling the client asked
for, n, echo) and render the events back. Everything that is the same in every dialect lives
here once: model identity and readiness, chat-template rendering and tokenization, sampling
resolution (SPEC §3), n > 1 fan-out, logprobs and echo, usage, cancellation and the access
log.

Lifecycle of one generation: `Core.start()` does every check that can fail (sampling ranges,
context length, token ids) before anything reaches the engine and raises typed errors;
the returned CoreStream is an async context manager, whose exit (normal, error, client
gone, task cancelled) aborts whatever is still running in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from argosy.api.access_log import GenerationTiming, access_log, format_line
from argosy.api.admission import AdmissionQueue, Ticket
from argosy.api.chat_channels import ChannelSpec, ChoiceChannels
from argosy.api.choice import ChoiceState
from argosy.api.constraints import GuideFactory
from argosy.api.errors import APIError
from argosy.api.grammar_service import GrammarService
from argosy.api.sessions_bridge import GenerationRecord, SessionRecorder, SessionSpec, new_record
from argosy.api.token_text import TokenTexts
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
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.config import EngineConfig, ServerConfig
from argosy.engine.outputs import EngineStats, RequestOutput
from argosy.errors import ArgosyError, EngineDeadError, InvalidRequestError, NotFoundError
from argosy.sampling_params import (
    ModelSamplingDefaults,
    RequestSampling,
    effective_defaults,
    resolve_sampling,
)

if TYPE_CHECKING:
    from argosy.engine.async_engine import AsyncEngine

log = logging.getLogger("argosy.api")

_SEED_RANGE = 2**64  # torch seeds are 64-bit


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
    guide_factory: GuideFactory | None = None  # a fresh grammar guide per choice
    arrival_time: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What /v1/models-style endpoints describe; context_length etc. None while loading."""

    id: str
    created: int
    is_loaded: bool
    context_length: int | None
    architecture: str | None
    dtype: str | None
    quantization: str | None
    has_chat_template: bool
    sampling_defaults: dict[str, float | int]
    has_thinking: bool = False  # its family writes a reasoning channel
    has_tools: bool = False  # tools and tool_choice work (its template's or our own tool prompt)
    speculative: str = "none"  # speculative decoding method (--speculative)
    weights: str | None = None  # how the weights are held and computed, e.g. "int4 (GGUF Q4 blocks) ..."
    compiled_decode: bool | None = None  # decode steps run a torch.compile graph


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


# -- the core -------------------------------------------------------------------------------


class Core:
    """The one model this process serves: identity, readiness, and the way to the engine."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.server_config = server_config
        self.model_id = server_config.served_model_name or engine_config.model
        self.created = int(time.time())
        self._engine: AsyncEngine | None = None
        self._load_error: str | None = None
        self._template: ChatTemplate | None = None
        self._template_error: ArgosyError | None = None
        self._chat_profile: ChatProfile | None = None
        self.grammar: GrammarService | None = None  # set at attach; builds its backend on first use
        self._token_texts: TokenTexts | None = None
        self._model_defaults: ModelSamplingDefaults | None = None
        self._names = {self.model_id, engine_config.model}
        self._ids = itertools.count()
        self.admission = AdmissionQueue(server_config.max_queued_requests)
        self.sessions: SessionRecorder | None = None  # set by the server once the store is open

    # -- lifecycle ---------------------------------------------------------------------
    def attach(self, engine: AsyncEngine) -> None:
        """The model finished loading; from now on generations are served."""
        source = engine.engine.source
        self._model_defaults = ModelSamplingDefaults.from_generation_config(source.generation_config)
        if self._model_defaults.ignored:
            log.warning(
                "generation_config.json values ignored (malformed): %s",
                ", ".join(self._model_defaults.ignored),
            )
        if source.chat_template:
            try:
                self._template = ChatTemplate(
                    source.chat_template, bos_token=source.bos_token, eos_token=source.eos_token
                )
            except ArgosyError as exc:
                log.warning("%s", exc.message)
                self._template_error = exc
        if self._template is not None:
            self._chat_profile = ChatProfile(self._template, source.tokenizer)
        self.grammar = GrammarService(source.tokenizer, engine.engine.vocab_size, source.eos_token_ids)
        self._token_texts = TokenTexts(source.tokenizer)
        self._names.add(source.name)
        self._engine = engine

    def fail(self, message: str) -> None:
        self._load_error = message

    @property
    def state(self) -> str:
        """One of: loading, ready, failed (the model did not load), dead (the engine stopped)."""
        if self._load_error is not None:
            return "failed"
        if self._engine is None:
            return "loading"
        return "ready" if self._engine.is_alive else "dead"

    def require_engine(self) -> AsyncEngine:
        if self._engine is not None:
            if not self._engine.is_alive:
                raise EngineDeadError(f"The engine stopped: {self._engine.dead_error}")
            return self._engine
        if self._load_error is not None:
            raise APIError("model_load_error", f"Model {self.model_id!r} failed to load: {self._load_error}")
        raise APIError(
            "model_loading",
            f"Model {self.model_id!r} is still loading; retry shortly.",
            code="model_loading",
            headers={"retry-after": "1"},
        )

    def resolve_model(self, requested: str | None) -> str:
        """The served id for a request's `model` (None: the one model served)."""
        if requested is None or requested in self._names:
            return self.model_id
        raise NotFoundError(
            f"The model '{requested}' does not exist; this server serves '{self.model_id}'.",
            param="model",
            code="model_not_found",
        )

    def model_info(self) -> ModelInfo:
        engine = self._engine.engine if self._engine is not None else None
        return ModelInfo(
            id=self.model_id,
            created=self.created,
            is_loaded=engine is not None,
            context_length=engine.max_model_len if engine is not None else None,
            architecture=engine.source.architecture if engine is not None else None,
            dtype=str(engine.dtype).removeprefix("torch.") if engine is not None else None,
            quantization=engine.source.gguf_file_type if engine is not None else None,
            has_chat_template=self._template is not None,
            sampling_defaults=effective_defaults(
                self.server_config.operator_sampling,
                self._model_defaults,
                speculation_enabled=self.engine_config.speculation_enabled,
            ),
            speculative=self.engine_config.speculative,
            weights=engine.weights if engine is not None else None,
            compiled_decode=engine.compiled if engine is not None else None,
            has_thinking=self._chat_profile is not None and self._chat_profile.has_reasoning,
            has_tools=self._chat_profile is not None,
        )

    def engine_stats(self) -> tuple[EngineStats, int]:
        """(engine counters, requests in flight through the async engine)."""
        engine = self.require_engine()
        return engine.stats(), engine.num_in_flight()

    # -- prompts -------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """A raw prompt's token ids, with the BOS the model's tokenizer config asks for."""
        return self.require_engine().engine.encode(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render the conversation with the model's chat template and tokenize it. Like
        transformers, no special tokens are added: the template writes its own."""
        return self.encode_rendered(self.render_chat(messages, template_kwargs))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as the model's chat template writes it (the prompt text)."""
        return self.chat_profile().template.render(
            messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )

    def chat_profile(self) -> ChatProfile:
        """The model's chat template, family and markers (argosy/chat/profile.py)."""
        self.require_engine()
        if self._chat_profile is None:
            if self._template_error is not None:
                raise self._template_error
            raise InvalidRequestError(
                f"Model {self.model_id!r} has no chat template; use /v1/completions with a raw prompt.",
                param="messages",
            )
        return self._chat_profile

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of template-rendered text (no special tokens added: it writes its own)."""
        tokenizer = self.require_engine().engine.source.tokenizer
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (what the model saw)."""
        text: str = self.require_engine().engine.source.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text

    # -- generation ----------------------------------------------------------------------
    def start(self, request: CoreRequest) -> CoreStream:
        """Resolve and check everything for every choice; raise before the engine is touched."""
        engine = self.require_engine()
        assert self._token_texts is not None and self._model_defaults is not None
        llm = engine.engine
        choices: list[ChoiceState] = []
        for prompt_index, prompt_ids in enumerate(request.prompts):
            param = (
                request.prompt_param
                if len(request.prompts) == 1
                else f"{request.prompt_param}[{prompt_index}]"
            )
            try:
                for j in range(request.n):
                    params = resolve_sampling(
                        request.sampling,
                        self.server_config.operator_sampling,
                        self._model_defaults,
                        context_length=llm.max_model_len,
                        prompt_len=len(prompt_ids),
                        speculation_enabled=self.engine_config.speculation_enabled,
                    )
                    if request.sampling.seed is not None and j > 0:
                        # Reproducible, but the n samples of one prompt differ from each other.
                        params.seed = _offset_seed(request.sampling.seed, j)
                    params.batch_invariant = request.batch_invariant
                    llm.validate(prompt_ids, params, request.qos)
                    choices.append(
                        ChoiceState(
                            index=len(choices),
                            prompt_index=prompt_index,
                            prompt_ids=prompt_ids,
                            params=params,
                            echo=request.echo,
                            tokenizer=llm.source.tokenizer,
                            token_texts=self._token_texts,
                            channels=(
                                ChoiceChannels(request.channels, len(choices))
                                if request.channels is not None
                                else None
                            ),
                        )
                    )
            except ArgosyError as exc:
                if exc.param in ("prompt", "messages"):
                    exc.param = param
                raise
        record = new_record(self.sessions, request.session, request.prompts, request.route, choices)
        return CoreStream(
            engine,
            request,
            choices,
            self.model_id,
            f"gen-{next(self._ids)}",
            ticket=self.admission.admit(),  # last: a refused request holds no place
            record=record,
            timeout_s=self.server_config.request_timeout,
        )


def _offset_seed(seed: int, offset: int) -> int:
    shifted = (seed + offset) % _SEED_RANGE
    return shifted - _SEED_RANGE if seed < 0 and shifted >= 2**63 else shifted


# -- the stream -----------------------------------------------------------------------------


class CoreStream:
    """The events of one CoreRequest, all choices interleaved.

    Use as `async with core.start(req) as stream: async for event in stream: ...`. Each
    choice runs as its own engine request, pumped by its own task into one queue; leaving
    the block cancels the tasks, which closes their engine generators and so aborts those
    requests in the engine. `usage` is the whole request's so far: each prompt counted
    once whatever n is, completion tokens over all choices.

    Admission: the stream holds its `ticket` until its first engine output (or its end).
    Time limit: past `timeout_s` from arrival the engine requests are stopped and every
    unfinished choice finishes "length"; `degraded` then names "request_timeout" (dialects
    put it in x-argosy-degraded, or in a stream's trailing comment). Sessions: `record` sees
    every event and commits them when the stream ends (`record.committed`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request: CoreRequest,
        choices: list[ChoiceState],
        model_id: str,
        stream_id: str,
        *,
        ticket: Ticket | None = None,
        record: GenerationRecord | None = None,
        timeout_s: float | None = None,
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
        if self._ticket is not None:
            self._ticket.release()
        finish = ",".join(c.finish_reason or "abort" for c in self.choices)
        if exc is not None and not isinstance(exc, asyncio.CancelledError | GeneratorExit):
            finish = "error"
        if self.record is not None:
            self.record.commit("error" if finish == "error" else "abort")
        line = format_line(self.request.route, self.model_id, self.usage, self.timing, finish)
        access_log.info("%s request_id=%s", line, self.request.request_id)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        if not self._is_started:
            raise RuntimeError("iterate a CoreStream inside `async with`")
        num_unfinished = len(self.choices)
        while num_unfinished:
            try:
                index, item = await self._next_output()
            except TimeoutError:
                for event in self._time_out():
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
            for event in choice.on_output(item):
                self._observe(event)
                yield event
            if item.finished:
                num_unfinished -= 1

    async def _next_output(self) -> tuple[int, RequestOutput | BaseException]:
        if self._deadline is None:
            return await self._queue.get()
        remaining_s = self._deadline - time.perf_counter()
        if remaining_s <= 0:
            raise TimeoutError
        if not self._queue.empty():  # the common case under load: no timer needed
            return self._queue.get_nowait()
        return await asyncio.wait_for(self._queue.get(), remaining_s)

    def _time_out(self) -> list[Event]:
        """The wall-clock limit passed: stop the engine requests and finish every unfinished
        choice with "length" (through its own on_output, so it ends as any choice ends)."""
        log.warning("%s: request timeout; stopping it (finish_reason length)", self.request.request_id)
        self.degraded.append("request_timeout")
        for task in self._tasks:
            task.cancel()
        events: list[Event] = []
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
            events.extend(choice.on_output(last))
        return events

    def _observe(self, event: Event) -> None:
        if self.record is not None:
            self.record.add(event)

    async def _pump(self, choice: ChoiceState) -> None:
        outputs = self._engine.generate(
            choice.prompt_ids,
            choice.params,
            request_id=f"{self.id}-{choice.index}",
            qos=self.request.qos,
            guide=self.request.guide_factory() if self.request.guide_factory is not None else None,
        )
        try:
            async for out in outputs:
                self._queue.put_nowait((choice.index, out))
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
