"""One worker thread per model that a library runs (audio, images): requests queue for it in
arrival order, and a blocking generator (segments recognised, sentences synthesised, images
denoised) is handed to the event loop item by item as the library produces them.

On two cores one request at a time is the fastest order (CTranslate2, onnxruntime and torch
use every core for one request); concurrent requests wait, counted in `waiting`, and past
`max_waiting` a new one is refused (503 + Retry-After) instead of queueing without bound. A
consumer that stops early (a client gone) stops the generator at its next item.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.errors import OverloadedError

T = TypeVar("T")
_DONE = object()


class ModelWorker:
    def __init__(self, name: str, max_waiting: int = 64) -> None:
        self.name = name
        self.max_waiting = max_waiting
        self.waiting = 0  # requests queued behind the one running
        self.running = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{name}")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the worker thread, in turn. Returns once the thread counted the job ended
        (the end of the items, not the first one: `running` read after it is 0 when idle)."""
        (result,) = [item async for item in self.iterate(lambda: iter((fn(),)))]
        return result

    async def iterate(self, make: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
        """The items of `make()` (run on the worker thread) as they come."""
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def run() -> None:
            self._started()
            outcome: Any = _DONE
            try:
                for item in make():
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                    if stop.is_set():
                        break
            except BaseException as exc:  # handed to the consumer, raised there
                outcome = exc
            finally:
                # counted as ended before the consumer hears it: whoever sees the end sees
                # `running` without it (CI saw 1 left after the last job's result)
                self._finished()
            loop.call_soon_threadsafe(queue.put_nowait, outcome)

        future = self._executor.submit(run)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            if future.cancel():  # never started: it leaves the queue
                self._left_unstarted()

    def _admit(self) -> None:
        with self._lock:
            if self.waiting >= self.max_waiting:
                raise OverloadedError(
                    f"Model '{self.name}' has {self.waiting} requests waiting; try again shortly.",
                    retry_after_s=2,
                )
            self.waiting += 1

    def _started(self) -> None:
        with self._lock:
            self.waiting -= 1
            self.running += 1

    def _finished(self) -> None:
        with self._lock:
            self.running -= 1

    def _left_unstarted(self) -> None:
        with self._lock:
            self.waiting -= 1


class WorkerModel:
    """A loaded model that a library runs on its own ModelWorker (audio, images): its identity,
    liveness and shutdown, and the description fields every such model shares."""

    kind: ClassVar[str]

    def _start_worker(self, model_id: str, created: int | None) -> None:
        self.model_id = model_id
        self.created = created if created is not None else int(time.time())
        self.worker = ModelWorker(model_id)
        self._alive = True

    @property
    def is_alive(self) -> bool:
        return self._alive

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self._alive = False
        self.worker.shutdown()

    def _info(self, state: str, **fields: Any) -> ModelInfo:
        """The model's ModelInfo: `fields` are what only it knows (architecture, dtype, ...)."""
        return ModelInfo(
            id=self.model_id,
            created=self.created,
            kind=self.kind,
            state=state if self.is_alive else "dead",
            is_loaded=True,
            context_length=None,
            has_chat_template=False,
            sampling_defaults={},
            **fields,
        )
