"""GrammarService: a model's grammar backend, owned by its engine (grammars reach it as plain
GrammarSpec data and are compiled where the engine runs), built on first use, compiling off the
event loop under a deadline.

Building the backend (importing xgrammar, reading the vocabulary) takes a second or so and
runs once in a worker thread. Compiled grammars are cached by the backend (by the spec's
canonical text), so a schema is compiled once per model; a cache hit is answered at once.

Compiles run one at a time on a dedicated thread (`_CompileWorker`), never on the event loop's
default pool. A compile cannot be interrupted (it is C++), so the deadline is kept by
abandoning it: once one has run `compile_deadline_s`, whichever request polls first retires
that worker (its thread finishes the compile in the background, then exits) and later
compiles go to a fresh worker; compiles queued behind the slow one move to the fresh worker
instead of waiting for it. The slow request gets a 400, and its spec (by a digest of its cache
key) is remembered, so a retry of the same grammar is refused at once instead of occupying
another thread. At most `max_abandoned` abandoned compiles may run at once; past that a new
compile is refused with a 503 until one finishes, so a stream of distinct slow grammars cannot
take every core. The deadline counts a compile's own running time, not its wait in the queue.

Worker threads are not daemons: a process that exits while an abandoned compile runs waits for
it (xgrammar aborts the process if its C++ thread pool is torn down mid-compile). The static
limits in core/constraints.py keep the worst such compile to seconds; an idle worker's thread
exits within `_IDLE_EXIT_S`, so it delays exit no longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from tokenizers import Tokenizer

from argosy.errors import InvalidRequestError, OverloadedError
from argosy.runner.structured import (
    CompiledGrammar,
    GrammarBackend,
    GrammarSpec,
    TokenGuide,
    make_grammar_backend,
)

log = logging.getLogger("argosy.engine")

# A large legitimate schema compiles in about a second (a 50 KiB object of 2,000 properties:
# 1.2 s on SmolLM2's vocabulary, on a busy CPU); ten times that is a grammar built to be slow.
COMPILE_DEADLINE_S = 10.0
MAX_ABANDONED_COMPILES = 2  # abandoned compiles still running before new ones are refused
MAX_TIMED_OUT_SPECS = 1024  # digests of specs refused for their compile time (oldest forgotten)
_POLL_S = 0.05  # how often a waiting request checks the running compile's deadline
_IDLE_EXIT_S = 0.5  # an idle worker's thread exits (the next compile starts another, ~0.1 ms)


class _CompileJob:
    """One request's compile: queued on a worker, claimed by its thread when it starts, or
    withdrawn by its waiter before that (it is then skipped). The result reaches the waiter's
    event loop through `future`; a waiter that stopped waiting is not told."""

    def __init__(self, spec: GrammarSpec, digest: str, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.digest = digest
        self.future: asyncio.Future[CompiledGrammar] = loop.create_future()
        self.started_at: float | None = None  # time.monotonic() when its thread began it
        self.is_timed_out = False
        self.is_orphaned = False  # its waiter gave up (timed out or cancelled)
        self._loop = loop
        self._lock = threading.Lock()
        self._is_withdrawn = False

    def claim(self) -> bool:
        """On the worker thread: True if the job should run now (it was not withdrawn)."""
        with self._lock:
            if self._is_withdrawn:
                return False
            self.started_at = time.monotonic()
            return True

    def withdraw(self) -> bool:
        """On the waiter: True if the job will never run (it had not started)."""
        with self._lock:
            if self.started_at is None:
                self._is_withdrawn = True
            return self._is_withdrawn

    def settle(self, compiled: CompiledGrammar | None, error: BaseException | None) -> None:
        if self.is_orphaned:
            return
        with contextlib.suppress(RuntimeError):  # the waiter's event loop is closed
            self._loop.call_soon_threadsafe(self._settle_on_loop, compiled, error)

    def _settle_on_loop(self, compiled: CompiledGrammar | None, error: BaseException | None) -> None:
        if self.future.done() or self.is_orphaned:
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            assert compiled is not None
            self.future.set_result(compiled)


class _CompileWorker:
    """A queue of compile jobs run in order by one thread, started on demand; the thread exits
    once retired and drained, or after `_IDLE_EXIT_S` without work."""

    def __init__(self, backend: GrammarBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._jobs: deque[_CompileJob] = deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._is_retired = False
        self.running: _CompileJob | None = None

    @property
    def is_alive(self) -> bool:
        with self._condition:
            return self._thread is not None

    def submit(self, job: _CompileJob) -> None:
        with self._condition:
            assert not self._is_retired, "a retired worker takes no jobs"
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=False)
                self._thread.start()
            else:
                self._condition.notify()

    def retire(self) -> None:
        with self._condition:
            self._is_retired = True
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                if not self._jobs and not self._is_retired:
                    self._condition.wait(_IDLE_EXIT_S)
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
                if not job.claim():
                    continue
                self.running = job
            try:
                job.settle(self._backend.compile(job.spec), None)
            except Exception as exc:  # delivered to the waiter, which raises it
                job.settle(None, exc)
            finally:
                with self._condition:
                    self.running = None


class GrammarService:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend_name: str = "xgrammar",
        *,
        compile_deadline_s: float = COMPILE_DEADLINE_S,
        max_abandoned: int = MAX_ABANDONED_COMPILES,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.backend_name = backend_name
        self.compile_deadline_s = compile_deadline_s
        self.max_abandoned = max_abandoned
        self._backend: GrammarBackend | None = None
        self._build_lock = threading.Lock()  # held while the backend is built (seconds)
        self._lock = threading.Lock()  # guards the worker and the timed-out set (never held long)
        self._worker: _CompileWorker | None = None
        self._abandoned: list[_CompileWorker] = []
        self._timed_out: OrderedDict[str, None] = OrderedDict()
        self.num_compiles_started = 0  # compiles handed to a worker (cache hits and refusals not)
        self.num_timed_out = 0

    async def compile(self, spec: GrammarSpec, param: str | None = None) -> CompiledGrammar:
        """`spec` compiled (or from the cache); a 400 naming `param` when it cannot be, or when
        compiling it took longer than the deadline (now or before)."""
        try:
            return await self._compile(spec)
        except InvalidRequestError as exc:
            exc.param = exc.param or param
            raise

    def guide(self, compiled: CompiledGrammar) -> TokenGuide:
        """A fresh matcher for one choice (cheap)."""
        return self._require_backend().guide(compiled)

    async def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        backend = (
            self._backend if self._backend is not None else await asyncio.to_thread(self._require_backend)
        )
        digest = hashlib.sha256(spec.cache_key().encode()).hexdigest()
        self._refuse_if_timed_out(spec, digest)
        cached = backend.cached(spec)
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        while True:
            self._refuse_if_timed_out(spec, digest)  # again: the same grammar may have timed out ahead
            job = _CompileJob(spec, digest, loop)
            worker = self._submit(backend, job)
            try:
                if await self._wait(worker, job):
                    return job.future.result()
            except BaseException:
                job.is_orphaned = True
                job.withdraw()
                raise

    def _refuse_if_timed_out(self, spec: GrammarSpec, digest: str) -> None:
        with self._lock:
            if digest not in self._timed_out:
                return
            self._timed_out.move_to_end(digest)
        raise InvalidRequestError(
            f"This {spec.kind} grammar took longer than {self.compile_deadline_s:g} s to compile "
            "before; it is not compiled again. Simplify it (fewer or smaller counted repetitions "
            "in `pattern`, fewer properties or alternatives)."
        )

    def _submit(self, backend: GrammarBackend, job: _CompileJob) -> _CompileWorker:
        with self._lock:
            self._abandoned = [worker for worker in self._abandoned if worker.is_alive]
            if len(self._abandoned) >= self.max_abandoned:
                raise OverloadedError(
                    f"The grammar compiler is busy with {len(self._abandoned)} compiles that ran past "
                    f"their {self.compile_deadline_s:g} s deadline; retry shortly.",
                    retry_after_s=max(1, round(self.compile_deadline_s)),
                )
            if self._worker is None:
                self._worker = _CompileWorker(backend, "argosy-grammar")
            self._worker.submit(job)
            self.num_compiles_started += 1
            return self._worker

    async def _wait(self, worker: _CompileWorker, job: _CompileJob) -> bool:
        """Wait for `job`: True once its future is done; False if it was withdrawn from a
        retired worker before it started (the caller queues it again); a 400 past the deadline."""
        poll_s = min(_POLL_S, self.compile_deadline_s / 4)
        while not job.future.done():
            await asyncio.wait({job.future}, timeout=poll_s)
            if job.future.done():
                break
            self._enforce_deadline(worker)
            if job.is_timed_out:
                raise InvalidRequestError(
                    f"This {job.spec.kind} grammar took longer than {self.compile_deadline_s:g} s to "
                    "compile; it was abandoned. Simplify it (fewer or smaller counted repetitions in "
                    "`pattern`, fewer properties or alternatives)."
                )
            if worker is not self._worker and job.withdraw():
                return False
        return True

    def _enforce_deadline(self, worker: _CompileWorker) -> None:
        """Time out `worker`'s running compile if it is past the deadline, and retire `worker`
        if it is the current one. Every waiter checks the worker its job is queued on, so each
        worker anyone waits on is checked (a compile whose own waiter left is timed out by the
        next request that queues behind it)."""
        with self._lock:
            running = worker.running
            if running is None or running.started_at is None or running.is_timed_out:
                return
            if time.monotonic() - running.started_at < self.compile_deadline_s:
                return
            running.is_timed_out = True
            running.is_orphaned = True
            self._timed_out[running.digest] = None
            while len(self._timed_out) > MAX_TIMED_OUT_SPECS:
                self._timed_out.popitem(last=False)
            self.num_timed_out += 1
            if worker is self._worker:
                worker.retire()
                self._abandoned.append(worker)
                self._worker = None
        log.warning(
            "a %s grammar ran past its %.3g s compile deadline; abandoned (its thread finishes it)",
            running.spec.kind,
            self.compile_deadline_s,
        )

    def _require_backend(self) -> GrammarBackend:
        with self._build_lock:
            if self._backend is None:
                try:
                    self._backend = make_grammar_backend(
                        self.backend_name, self._tokenizer, self._vocab_size, self._stop_token_ids
                    )
                except ImportError as exc:
                    log.warning("grammar backend %s unavailable: %s", self.backend_name, exc)
                    raise InvalidRequestError(
                        f"Constrained decoding is not available on this server ({self.backend_name} "
                        f"is not installed: {exc})."
                    ) from exc
            return self._backend
