"""EmbeddingEngine (sync) and AsyncEmbeddingEngine: token ids in, one vector per input out.

EmbeddingEngine owns the tokenizer and the encoder. `embed()` runs the whole batch packed
(see models/bert.py), cut into forwards of at most `max_batch_tokens` tokens so activations
stay bounded (~100 MB at 16k tokens for MiniLM).

AsyncEmbeddingEngine runs every forward on one worker thread, which also builds the model (a
model loaded on another thread runs slower here: see engine/async_engine.py). Concurrent
callers are coalesced: each `embed()` queues its inputs; the worker takes everything pending,
up to `max_batch_tokens`, runs it as one batch and resolves each caller's future on the
caller's loop. Many small requests thus cost about one forward, not one each. Inputs are
validated in the caller, so a bad request raises there and never reaches the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from argosy.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, ModelLoadError
from argosy.models.bert import BertEmbedder, PackedBatch, build_bert_embedder
from argosy.models.embedding_source import EmbeddingSource, load_embedding_source

DEFAULT_MAX_BATCH_TOKENS = 16384


class PackedEncoderEngine:
    """What an EmbeddingEngine and a CrossEncoderEngine share: the length limits set at load,
    the checks of a batch's inputs, and the batch run in forwards of at most
    `max_batch_tokens` tokens. A subclass sets `source` (its name, config and longest input),
    then calls `_set_limits`, and writes `_forward` (one row of floats per input)."""

    _input_noun = "input"  # what an error calls one input
    _input_param = "input"  # the request field an error names
    source: Any  # an EmbeddingSource or a CrossEncoderSource
    max_batch_tokens: int
    num_forwards: int
    vocab_size: int

    def _set_limits(
        self, max_input_tokens: int | None, max_batch_tokens: int, bounds: tuple[int, int], note: str = ""
    ) -> None:
        """`max_input_tokens` (None: the source's own) within `bounds`, else ModelLoadError;
        `max_batch_tokens` must hold one longest input."""
        if max_input_tokens is not None:
            low, high = bounds
            if not low <= max_input_tokens <= high:
                raise ModelLoadError(
                    f"max_model_len {max_input_tokens} for {self.source.name}: must be in {low}..{high}{note}"
                )
            self.source.max_seq_length = max_input_tokens
        if max_batch_tokens < self.source.max_seq_length:
            raise InvalidRequestError(
                f"max_batch_tokens ({max_batch_tokens}) must hold one longest {self._input_noun} "
                f"({self.source.max_seq_length} tokens)",
                "max_batch_tokens",
            )
        self.max_batch_tokens = max_batch_tokens
        self.num_forwards = 0  # model forward calls so far (one per sub-batch)

    @property
    def name(self) -> str:
        return str(self.source.name)

    @property
    def max_input_tokens(self) -> int:
        """Longest accepted input, special tokens included."""
        return int(self.source.max_seq_length)

    def _check_inputs(self, inputs: list[list[int]], id_limit: int, outside: str) -> None:
        """Raise InvalidRequestError (ContextLengthExceededError for length) for an empty or
        over-long input, or one with an id outside [0, `id_limit`) (`outside` says so)."""
        noun, param = self._input_noun, self._input_param
        for index, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequestError(f"{noun} {index} is empty", param)
            if len(ids) > self.max_input_tokens:
                raise ContextLengthExceededError(
                    f"{noun} {index} has {len(ids)} tokens; this model takes at most {self.max_input_tokens}",
                    param,
                )
            if min(ids) < 0 or max(ids) >= id_limit:
                raise InvalidRequestError(f"{noun} {index} has {outside}", param)

    def validate(self, inputs: list[list[int]]) -> None:
        raise NotImplementedError

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One row per input, in order; raises InvalidRequestError before any work."""
        self.validate(inputs)
        rows: list[list[float]] = []
        for start, stop in _token_budget_slices(inputs, self.max_batch_tokens):
            rows.extend(self._forward(inputs[start:stop]).tolist())
        return rows

    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        raise NotImplementedError


class EmbeddingEngine(PackedEncoderEngine):
    """Not thread-safe: one thread calls `embed()` (tokenize/truncate are safe anywhere)."""

    def __init__(
        self,
        model: str | Path | EmbeddingSource = "minilm",
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        dtype: torch.dtype = torch.float32,
        max_input_tokens: int | None = None,
    ) -> None:
        """`max_input_tokens`: the longest input accepted (default: the model's
        sentence-transformers max_seq_length; at most its position table)."""
        self.source: EmbeddingSource = (
            model if isinstance(model, EmbeddingSource) else load_embedding_source(model)
        )
        max_positions = int(self.source.hf_config.get("max_position_embeddings", 512))
        self._set_limits(max_input_tokens, max_batch_tokens, (2, max_positions), " (its position table)")
        self.model: BertEmbedder = build_bert_embedder(
            self.source.hf_config, self.source.path, self.source.pooling, self.source.normalize, dtype
        )
        self.vocab_size = self.model.config.vocab_size
        self._num_trailing_special = _num_trailing_special_tokens(self.source)

    @property
    def dimensions(self) -> int:
        return self.source.dimensions

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the special tokens the tokenizer adds ([CLS] ... [SEP]); never truncated."""
        if self.source.do_lower_case:
            texts = [t.lower() for t in texts]
        return [e.ids for e in self.source.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def truncate(self, token_ids: list[int]) -> list[int]:
        """`token_ids` (from tokenize) cut to max_input_tokens the way sentence-transformers
        cuts text: the trailing special tokens ([SEP]) are kept."""
        limit, trailing = self.max_input_tokens, self._num_trailing_special
        if len(token_ids) <= limit:
            return token_ids
        return token_ids[: limit - trailing] + token_ids[len(token_ids) - trailing :]

    def validate(self, inputs: list[list[int]]) -> None:
        """Raise InvalidRequestError (ContextLengthExceededError for length) for an input the
        model cannot embed."""
        outside = f"a token id outside the vocabulary [0, {self.vocab_size})"
        self._check_inputs(inputs, self.vocab_size, outside)

    @torch.inference_mode()
    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        self.num_forwards += 1
        return self.model(PackedBatch.build(inputs)).float()


def _token_budget_slices(inputs: list[list[int]], budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) slices of at most `budget` tokens (one input always fits)."""
    slices: list[tuple[int, int]] = []
    start, num_tokens = 0, 0
    for index, ids in enumerate(inputs):
        if num_tokens + len(ids) > budget and index > start:
            slices.append((start, index))
            start, num_tokens = index, 0
        num_tokens += len(ids)
    if start < len(inputs):
        slices.append((start, len(inputs)))
    return slices


def _num_trailing_special_tokens(source: EmbeddingSource) -> int:
    """How many special tokens the post-processor appends after the text (1 for BERT's [SEP])."""
    mask = source.tokenizer.encode("a", add_special_tokens=True).special_tokens_mask
    count = 0
    while count < len(mask) and mask[len(mask) - 1 - count]:
        count += 1
    return count


@dataclass(slots=True)
class _Job:
    inputs: list[list[int]]
    num_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[list[float]]]


def _settle(future: asyncio.Future[list[list[float]]], result: list[list[float]] | BaseException) -> None:
    """On the caller's loop: resolve the future unless the caller gave up on it."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


@runtime_checkable
class BatchEncoder(Protocol):
    """What the worker below runs: an encoder that takes many token-id inputs in one call (an
    EmbeddingEngine; a CrossEncoderEngine, whose inputs are text pairs)."""

    max_batch_tokens: int
    num_forwards: int

    @property
    def max_input_tokens(self) -> int: ...

    @property
    def dimensions(self) -> int: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def truncate(self, token_ids: list[int]) -> list[int]: ...

    def validate(self, inputs: list[list[int]]) -> None: ...

    def embed(self, inputs: list[list[int]]) -> list[list[float]]: ...


EncoderT = TypeVar("EncoderT", bound=BatchEncoder)


class AsyncEmbeddingEngine(Generic[EncoderT]):
    """Give it an encoder (an EmbeddingEngine), or better a function that builds one on the
    worker thread."""

    def __init__(
        self,
        engine: EncoderT | Callable[[], EncoderT],
        max_batch_tokens: int | None = None,
    ) -> None:
        self._build: Callable[[], EncoderT] | None = None
        self.engine: EncoderT  # set here or, from `_build`, on the worker before `_built`
        if isinstance(engine, BatchEncoder):
            self.engine = engine
        else:
            self._build = engine
        self._max_batch_tokens = max_batch_tokens
        self._pending: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="argosy-embeddings", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # -- public API ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and not self._stopped and self._thread.is_alive()

    @property
    def num_forwards(self) -> int:
        return self.engine.num_forwards

    @property
    def max_input_tokens(self) -> int:
        return self.engine.max_input_tokens

    @property
    def dimensions(self) -> int:
        return self.engine.dimensions

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.engine.tokenize(texts)

    def truncate(self, token_ids: list[int]) -> list[int]:
        return self.engine.truncate(token_ids)

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order. Raises InvalidRequestError at once for a bad input,
        EngineDeadError when the worker has stopped."""
        self.engine.validate(inputs)
        if not inputs:
            return []
        loop = asyncio.get_running_loop()
        job = _Job(inputs, sum(len(ids) for ids in inputs), loop, loop.create_future())
        with self._cond:
            if not self.is_alive:
                raise EngineDeadError("the embedding engine has stopped") from self.dead_error
            self._pending.append(job)
            self._cond.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            with self._cond, contextlib.suppress(ValueError):
                self._pending.remove(job)  # not taken yet: the worker never sees it
            raise

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current forward; pending callers get EngineDeadError."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # -- worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
        except BaseException as exc:  # reported to the constructor's caller
            self._build_error = exc
            self._built.set()
            return
        self._built.set()
        budget = self._max_batch_tokens or self.engine.max_batch_tokens
        try:
            while True:
                jobs = self._take(budget)
                if not jobs:
                    break
                self._serve(jobs)
        except BaseException as exc:
            self.dead_error = exc
        finally:
            self._fail_pending(EngineDeadError("the embedding engine has stopped"))

    def _take(self, budget: int) -> list[_Job]:
        """Block until work arrives; then every pending job that fits `budget` tokens (at least
        one). [] once stopped."""
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return []
            jobs = [self._pending.popleft()]
            num_tokens = jobs[0].num_tokens
            while self._pending and num_tokens + self._pending[0].num_tokens <= budget:
                num_tokens += self._pending[0].num_tokens
                jobs.append(self._pending.popleft())
            return jobs

    def _serve(self, jobs: list[_Job]) -> None:
        inputs = [ids for job in jobs for ids in job.inputs]
        try:
            vectors = self.engine.embed(inputs)
        except Exception as exc:  # a failed forward fails its callers, not the worker
            for job in jobs:
                self._resolve(job, exc)
            return
        offset = 0
        for job in jobs:
            self._resolve(job, vectors[offset : offset + len(job.inputs)])
            offset += len(job.inputs)

    def _fail_pending(self, error: BaseException) -> None:
        with self._cond:
            self._stopped = True
            jobs = list(self._pending)
            self._pending.clear()
        for job in jobs:
            self._resolve(job, error)

    @staticmethod
    def _resolve(job: _Job, result: list[list[float]] | BaseException) -> None:
        # RuntimeError: the caller's event loop is closed, so nobody is listening
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(_settle, job.future, result)
