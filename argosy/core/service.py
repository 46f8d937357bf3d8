"""The core: CoreRequest -> a stream of neutral events. The ONLY caller of the engine.

Dialects turn a request into a CoreRequest (prompt token ids, the sampling the client asked
for, n, echo) and render the events back. Everything that is the same in every dialect lives
here once: model identity and readiness, chat-template rendering and tokenization, sampling
resolution (SPEC §3), n > 1 fan-out, logprobs and echo, usage, cancellation and the access
log.

Lifecycle of one generation: `Core.start()` does every check that can fail (sampling ranges,
context length, token ids) before anything reaches the engine and raises typed errors;
the returned CoreStream (core_stream.py) is an async context manager, whose exit (normal,
error, client gone, task cancelled) aborts whatever is still running in the engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from argosy.api.errors import APIError
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.config import EngineConfig, ServerConfig
from argosy.core.admission import AdmissionQueue
from argosy.core.channels import ChoiceChannels
from argosy.core.choice import ChoiceState
from argosy.core.grammar_service import GrammarService
from argosy.core.recording import SessionRecorder, new_record
from argosy.core.stream import CoreRequest, CoreStream
from argosy.core.token_text import TokenTexts
from argosy.engine.arrivals import Arrival
from argosy.engine.outputs import EngineStats
from argosy.errors import ArgosyError, EngineDeadError, InvalidRequestError, NotFoundError
from argosy.sampling_params import (
    ModelSamplingDefaults,
    effective_defaults,
    resolve_sampling,
)

if TYPE_CHECKING:
    from argosy.engine.async_engine import AsyncEngine

log = logging.getLogger("argosy.api")

_SEED_RANGE = 2**64  # torch seeds are 64-bit


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

    def arriving(self) -> Arrival:
        """A generation request on its way to the engine (see AsyncEngine.arriving)."""
        engine = self._engine
        return engine.arriving() if engine is not None and engine.is_alive else Arrival()

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
