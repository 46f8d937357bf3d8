"""AsyncEngine: the step loop on its own thread; one asyncio queue per request.

`generate()` queues the request for the engine thread (which validates it in `add_request`:
a bad request raises from the first iteration; the core checks requests before they get
here, so its clients get their 400 before any stream starts), and yields RequestOutputs as
they arrive — with text deltas and stop strings applied when the request asks for
detokenization. Leaving the iteration early
(client gone, task cancelled) aborts the request; the engine frees its blocks at the start
of its next step. The engine thread is the only one that touches LLMEngine.

`embed()` queues pooling requests (prefill-only, argosy/runner/pooler.py) for the same engine:
one per input, all added in one command so they share their first step, and returns their
vectors in order; leaving early (cancelled) aborts the ones not finished.

Arrivals: requests on their way to the engine (the HTTP layer has them, their prompt is still
being rendered and tokenized) are counted (`arriving()`, handed back to
`generate(arrival=)`). When an idle engine wakes for a new request while others are still
arriving, it waits for them, up to ARRIVAL_WINDOW_S, so a burst is prefilled in one step: measured with 8 clients at once, the first request started alone
and the other seven, ~6 ms behind it, waited for its whole prefill step. A request arriving
alone never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from argosy.engine.adapters import AdapterSet
from argosy.engine.arrivals import Arrival
from argosy.engine.grammar_service import GrammarService
from argosy.engine.llm_engine import LLMEngine
from argosy.engine.output_processor import OutputProcessor
from argosy.engine.outputs import EngineStats, RequestOutput
from argosy.engine.sequence import ImagePlacement
from argosy.errors import ArgosyError, EngineDeadError, InvalidRequestError
from argosy.runner.structured import GrammarSpec, GuideSpec, TokenGuide, build_guide
from argosy.sampling_params import SamplingParams

log = logging.getLogger("argosy.engine")
_request_counter = itertools.count()

ARRIVAL_WINDOW_S = 0.02


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    qos: str
    guide: TokenGuide | None
    images: list[ImagePlacement] | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Pool:
    inputs: dict[str, list[int]]  # request id -> token ids
    pooling: str
    qos: str


@dataclass(slots=True)
class _Call:
    """Run `fn` on the engine thread between steps (what changes the engine's state: its LoRA
    adapters); its result or exception goes to `future`."""

    fn: Callable[[], object]
    future: asyncio.Future[object]


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's event loop is closed, so nobody is listening
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Give it an LLMEngine, or better a function that builds one: the engine is then built
    on the engine thread itself, so loading and every step share one OpenMP thread team
    (measured: a model loaded on another thread steps ~15% slower here, and ~55% slower when
    the main thread had also run a parallel op first)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        self._build = None if isinstance(engine, LLMEngine) else engine
        if isinstance(engine, LLMEngine):
            self.engine = engine
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Pool | _Call] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._num_arriving = 0
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="argosy-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        source = self.engine.source
        self.grammar = GrammarService(source.tokenizer, self.engine.vocab_size, source.eos_token_ids)
        self.description = self.engine.describe()

    # -- public API ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        """Every check of a request that needs no engine state; raises typed errors."""
        self.engine.validate(prompt_token_ids, params, qos)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the prefix cache holds now (a probe: read
        without a lock, so it may be stale by the time a request arrives)."""
        return self.engine.block_manager.probe_cached_prefix(token_ids)

    async def compile_grammar(self, spec: GrammarSpec, param: str | None = None) -> None:
        """Compile `spec` into this engine's cache; a 400 naming `param` when it cannot be."""
        await self.grammar.compile(spec, param)

    def arriving(self) -> Arrival:
        """Count a request that will reach `generate()` soon (see the module doc)."""
        with self._lock:
            self._num_arriving += 1
        return Arrival(self._arrived)

    def _arrived(self) -> None:
        with self._lock:
            self._num_arriving -= 1
        self._wakeup.set()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        qos: str = "interactive",
        guide: GuideSpec | None = None,
        arrival: Arrival | None = None,
        affinity: tuple[str, ...] = (),
        images: list[ImagePlacement] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; `arrival` (from `arriving()`) is marked done once queued;
        `affinity` is for a fleet's placement (one engine: nothing to place); `images`: a VLM
        prompt's (core/vision.py)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_error}")
        token_guide: TokenGuide | None = None
        if guide is not None:
            inner: TokenGuide | None = None
            if guide.grammar is not None:  # compiled already when the core checked it: a cache hit
                compiled = await self.grammar.compile(guide.grammar)
                inner = self.grammar.guide(compiled)
            token_guide = build_guide(guide, inner)
        request_id = request_id or f"req-{next(_request_counter)}"
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ArgosyError(f"Request id {request_id!r} is already in flight.")
            self._streams[request_id] = stream
        processor = OutputProcessor(self.engine.source.tokenizer, prompt_token_ids, params)
        self._send(_Add(request_id, list(prompt_token_ids), params, qos, token_guide, images))
        if arrival is not None:
            arrival.done()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                out = processor.process(item)
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished or not processor.engine_finished:
                self._send(_Abort(request_id))

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        pooling: str = "mean",
        qos: str = "interactive",
        arrival: Arrival | None = None,
    ) -> list[RequestOutput]:
        """One finished output per input, in order, each with its `embedding`. Raises the
        first input's error (ArgosyError) or EngineDeadError; aborts the rest on the way out."""
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_error}")
        request_ids = [f"pool-{next(_request_counter)}" for _ in inputs]
        stream = _Stream(asyncio.get_running_loop())  # one queue for the whole batch
        with self._lock:
            for request_id in request_ids:
                self._streams[request_id] = stream
        self._send(_Pool(dict(zip(request_ids, inputs, strict=True)), pooling, qos))
        if arrival is not None:
            arrival.done()
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(request_ids):
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None or item.embedding is None:
                    raise ArgosyError(f"Embedding failed: {item.error or item.finish_reason}")
                done[item.request_id] = item
        finally:
            with self._lock:
                for request_id in request_ids:
                    self._streams.pop(request_id, None)
            for request_id in request_ids:
                if request_id not in done:
                    self._send(_Abort(request_id))
        return [done[request_id] for request_id in request_ids]

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    # -- images (a VLM's, models/llava.py) -------------------------------------------------
    def vision_info(self) -> tuple[int, str, int] | None:
        """(image token id, its text, feature rows per image) of a VLM; None: text only."""
        vision = self.engine.vision
        if vision is None:
            return None
        text = self.engine.source.tokenizer.id_to_token(vision.image_token_id) or ""
        return vision.image_token_id, text, vision.num_image_tokens

    async def encode_images(self, images: list[Any]) -> list[Any]:
        """Each image's features (chat/images.py ImageParts), encoded off the event loop and
        beside the steps; an image seen lately is not encoded again."""
        vision = self.engine.vision
        assert vision is not None
        return await asyncio.to_thread(vision.features, images)

    # -- LoRA adapters (engine/adapters.py) -----------------------------------------------
    def adapters(self) -> list[dict[str, object]]:
        """The adapters this engine serves (name, id, path, rank, format); [] when LoRA is off."""
        adapters = self.engine.adapters
        return adapters.describe() if adapters is not None else []

    async def load_adapter(self, name: str, path: str) -> dict[str, object]:
        """Read, check and serve an adapter (on the engine thread: between two steps)."""
        return await self._call(lambda: self._adapter_set().add(name, path).describe())  # type: ignore[return-value]

    async def unload_adapter(self, name: str) -> None:
        await self._call(lambda: self._adapter_set().remove(name))

    def _adapter_set(self) -> AdapterSet:
        if self.engine.adapters is None:
            raise InvalidRequestError(
                "This model was started without LoRA: start it with --lora NAME=PATH or --enable-lora.",
                param="model",
            )
        return self.engine.adapters

    async def _call(self, fn: Callable[[], object]) -> object:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_error}")
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, future))
        return await future

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if self._built.is_set() and self._build_error is None:
            self.engine.stop_compiling()

    # -- engine thread -------------------------------------------------------------------
    def _send(self, command: _Add | _Abort | _Pool | _Call) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                continue
            if isinstance(command, _Pool):
                self._add_pooling(command)
                continue
            if isinstance(command, _Call):
                self._run_call(command)
                continue
            with self._lock:
                stream = self._streams.get(command.request_id)
            if stream is None:  # gone before it started
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.qos,
                    command.guide,
                    command.images,
                )
            except ArgosyError as exc:  # a bad request fails alone
                stream.put(exc)

    @staticmethod
    def _run_call(command: _Call) -> None:
        loop = command.future.get_loop()
        try:
            result = command.fn()
        except Exception as exc:  # noqa: BLE001 - the caller gets it (a typed error: its 4xx)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, command.future, None, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, command.future, result, None)

    def _add_pooling(self, command: _Pool) -> None:
        for request_id, token_ids in command.inputs.items():
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:  # gone before it started
                continue
            try:
                self.engine.add_pooling_request(request_id, token_ids, command.pooling, command.qos)
            except ArgosyError as exc:  # a bad input fails its batch (the caller raises it)
                stream.put(exc)

    def _await_arrivals(self) -> None:
        """Before an idle engine's first step: let the requests still arriving join it."""
        deadline = time.monotonic() + ARRIVAL_WINDOW_S
        while True:
            with self._lock:
                num_arriving = self._num_arriving
            remaining = deadline - time.monotonic()
            if num_arriving <= 0 or remaining <= 0:
                return
            self._wakeup.wait(remaining)
            self._wakeup.clear()
            self._drain_inbox()

    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
        try:
            idle = True
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    idle = True
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                if idle:
                    idle = False
                    self._await_arrivals()
                    continue
                for out in self.engine.step():
                    with self._lock:
                        stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop crashed")
            self.dead_error = exc
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(f"The engine stopped: {exc}"))


def _settle(future: asyncio.Future[object], result: object, error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
