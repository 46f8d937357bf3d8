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
from argosy.api.choice import ChoiceState
from argosy.api.errors import APIError
from argosy.api.token_text import TokenTexts
from argosy.chat.events import Event, Finish, PromptEcho, TextDelta, TokenLogprobs, Usage
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
    route: str = "-"  # for the access log, e.g. "POST /v1/completions"
    request_id: str = "-"  # the HTTP request's x-request-id, for the access log
    prompt_param: str = "prompt"  # the client field a prompt-sized error names
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


@dataclass(slots=True)
class CollectedChoice:
    """A finished choice, as `collect()` accumulates it for non-streaming responses."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    echo: PromptEcho | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
        self._token_texts: TokenTexts | None = None
        self._model_defaults: ModelSamplingDefaults | None = None
        self._names = {self.model_id, engine_config.model}
        self._ids = itertools.count()

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
            sampling_defaults=effective_defaults(self.server_config.operator_sampling, self._model_defaults),
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
        engine = self.require_engine()
        if self._template is None:
            if self._template_error is not None:
                raise self._template_error
            raise InvalidRequestError(
                f"Model {self.model_id!r} has no chat template; use /v1/completions with a raw prompt.",
                param="messages",
            )
        text = self._template.render(messages, add_generation_prompt=True, **(template_kwargs or {}))
        ids: list[int] = engine.engine.source.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

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
                    )
                    if request.sampling.seed is not None and j > 0:
                        # Reproducible, but the n samples of one prompt differ from each other.
                        params.seed = _offset_seed(request.sampling.seed, j)
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
                        )
                    )
            except ArgosyError as exc:
                if exc.param in ("prompt", "messages"):
                    exc.param = param
                raise
        return CoreStream(engine, request, choices, self.model_id, f"gen-{next(self._ids)}")


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
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request: CoreRequest,
        choices: list[ChoiceState],
        model_id: str,
        stream_id: str,
    ) -> None:
        self.request = request
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
        finish = ",".join(c.finish_reason or "abort" for c in self.choices)
        if exc is not None and not isinstance(exc, asyncio.CancelledError | GeneratorExit):
            finish = "error"
        line = format_line(self.request.route, self.model_id, self.usage, self.timing, finish)
        access_log.info("%s request_id=%s", line, self.request.request_id)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        if not self._is_started:
            raise RuntimeError("iterate a CoreStream inside `async with`")
        num_unfinished = len(self.choices)
        while num_unfinished:
            index, item = await self._queue.get()
            if isinstance(item, ArgosyError):
                raise item
            if isinstance(item, BaseException):
                raise ArgosyError(f"Generation failed: {type(item).__name__}: {item}") from item
            choice = self.choices[index]
            self.timing.stamp(index, item.num_output_tokens)
            for event in choice.on_output(item):
                yield event
            if item.finished:
                num_unfinished -= 1

    async def _pump(self, choice: ChoiceState) -> None:
        outputs = self._engine.generate(
            choice.prompt_ids,
            choice.params,
            request_id=f"{self.id}-{choice.index}",
            qos=self.request.qos,
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
            if event.logprobs and result.logprobs is not None:
                result.logprobs.extend(event.logprobs)
        elif isinstance(event, Finish):
            result.finish_reason = event.reason
            result.stop_reason = event.stop_reason
    return results
