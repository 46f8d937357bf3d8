"""GrammarService: a model's grammar backend, owned by its engine (grammars reach it as plain
GrammarSpec data and are compiled where the engine runs), built on first use, compiling off the
event loop.

Building the backend (importing xgrammar, reading the vocabulary) takes a second or so and
compiling a large schema can take longer: both run in a worker thread (`asyncio.to_thread`),
so the event loop keeps serving other requests. Compiled grammars are cached by the backend
(by the spec's canonical text), so a schema is compiled once per model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from tokenizers import Tokenizer

from argosy.errors import InvalidRequestError
from argosy.runner.structured import (
    CompiledGrammar,
    GrammarBackend,
    GrammarSpec,
    TokenGuide,
    make_grammar_backend,
)

log = logging.getLogger("argosy.engine")


class GrammarService:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend_name: str = "xgrammar",
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.backend_name = backend_name
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    async def compile(self, spec: GrammarSpec, param: str | None = None) -> CompiledGrammar:
        """`spec` compiled (or from the cache); a 400 naming `param` when it cannot be."""
        try:
            return await asyncio.to_thread(self._compile, spec)
        except InvalidRequestError as exc:
            exc.param = exc.param or param
            raise

    def guide(self, compiled: CompiledGrammar) -> TokenGuide:
        """A fresh matcher for one choice (cheap)."""
        return self._require_backend().guide(compiled)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self._require_backend().compile(spec)

    def _require_backend(self) -> GrammarBackend:
        with self._lock:
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
