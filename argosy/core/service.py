"""ModelService: one loaded generation model as the core sees it — its EngineClient, chat
template and profile, sampling defaults, admission queue — and the way its requests start.

Dialects turn a request into a CoreRequest (prompt token ids, the sampling the client asked
for, n, echo) and render the events back. Everything that is the same in every dialect lives
here once: model identity (and its `system_fingerprint`), chat-template rendering and
tokenization, sampling resolution (SPEC §3), n > 1 fan-out, logprobs and echo, usage,
cancellation and the access log.

Lifecycle of one generation: `ModelService.start()` does every check that can fail (sampling
ranges, context length, token ids) before anything reaches the engine and raises typed
errors; the returned CoreStream (stream.py) is an async context manager, whose exit (normal,
error, client gone, task cancelled) aborts whatever is still running in the engine.
The registry (registry.py) builds a ModelService once the model's engine is up.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from argosy import __version__
from argosy.chat.builtin_templates import builtin_template
from argosy.chat.fim import fim_dialect
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.config import ModelSpec, OperatorSampling, ServerConfig
from argosy.core.adapter_names import adapter_by_id
from argosy.core.admission import AdmissionQueue
from argosy.core.channels import ChoiceChannels
from argosy.core.choice import ChoiceState
from argosy.core.engine_client import EngineClient, NodeReport, NodeReporting, PoolingEngineClient
from argosy.core.recording import SessionRecorder, new_record
from argosy.core.stream import CoreRequest, CoreStream
from argosy.core.token_text import TokenTexts
from argosy.engine.arrivals import Arrival
from argosy.engine.outputs import EngineStats, ModelDescription
from argosy.errors import ArgosyError, EngineDeadError, InvalidRequestError
from argosy.runner.structured import GrammarSpec
from argosy.sampling_params import (
    ModelSamplingDefaults,
    effective_defaults,
    resolve_sampling,
)

log = logging.getLogger("argosy.api")

_SEED_RANGE = 2**64  # torch seeds are 64-bit


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What /v1/models-style endpoints describe; what is not known until it loads is None."""

    id: str
    created: int
    kind: str  # chat | embedding | transcription | speech
    state: str  # unloaded | loading | loaded | failed | dead
    is_loaded: bool
    context_length: int | None
    architecture: str | None
    dtype: str | None
    quantization: str | None
    has_chat_template: bool
    sampling_defaults: dict[str, float | int]
    aliases: tuple[str, ...] = ()
    has_thinking: bool = False  # its family writes a reasoning channel
    has_tools: bool = False  # tools and tool_choice work (its template's or our own tool prompt)
    speculative: str = "none"  # speculative decoding method (--speculative)
    weights: str | None = None  # how the weights are held and computed, e.g. "int4 (GGUF Q4 blocks) ..."
    compiled_decode: bool | None = None  # decode steps run a torch.compile graph now
    compile_status: str | None = None  # off | compiling | ready | failed (EngineStats)
    compiled_graphs: int | None = None  # decode graphs compiled in the process so far
    kernels: str | None = None  # the ops its steps run, e.g. native+invariant-avx512-vnni
    deterministic: bool | None = None  # tokens independent of batch, chunking, cache (--numerics invariant)
    dimensions: int | None = None  # the embedding's length (a chat model's: its hidden size)
    pooling: str | None = None  # how its embeddings pool the hidden states (mean, cls, ...)
    memory_bytes: int | None = None  # loaded: weights and buffers (+ KV pool), as allocated
    kv_cache: dict[str, object] | None = None  # loaded chat model: dtype, bytes_per_token, capacity_tokens
    accepts_images: bool = False  # a loaded vision-language model
    chat_template_source: str | None = None  # model | models file | built-in (<family>) | None
    tensor_formats: dict[str, str] | None = None  # a GGUF's types per weight role
    error: str | None = None  # failed: why it did not load
    has_fim: bool = False  # fill-in-the-middle tokens (`suffix` is served)
    tasks: tuple[str, ...] | None = None  # audio models: transcribe / translate / speech
    languages: tuple[str, ...] | None = None  # transcription models: the languages it knows
    voices: tuple[str, ...] | None = None  # speech models: the voices it speaks
    description: str | None = None  # audio models: what the model is
    # the `reasoning_effort` values its chat template takes (None: it does not read one)
    reasoning_effort_levels: tuple[str, ...] | None = None


def kv_cache_info(description: ModelDescription) -> dict[str, object] | None:
    """/v1/models' account of a chat model's KV cache (None where the engine gave none)."""
    if description.kv_bytes_per_token is None:
        return None
    return {
        "dtype": description.kv_cache_dtype,
        "bytes_per_token": description.kv_bytes_per_token,
        "capacity_tokens": description.kv_capacity_tokens,
    }


@dataclass(slots=True)
class ServiceOptions:
    """What a ModelService takes from the server's and the model's configuration."""

    operator_sampling: OperatorSampling = field(default_factory=OperatorSampling)
    speculative: str = "none"
    max_queued_requests: int = 256
    request_timeout: float | None = 600.0
    max_stream_buffer: int | None = 4096  # engine outputs a slow reader may leave unread
    chat_template: str | None = None  # the models file's, over the model's own
    tool_repair_budget: int = 1  # per request (argosy/core/tool_repair.py); a request's own wins
    kind: str = "chat"  # "rerank": a causal LM reranker, serving rerank and score (core/judge_scorer.py)
    max_images_per_request: int = 8  # a VLM's (core/vision.py)

    @classmethod
    def of(cls, spec: ModelSpec, server: ServerConfig, speculative: str) -> ServiceOptions:
        return cls(
            operator_sampling=spec.sampling or server.operator_sampling,
            speculative=speculative,
            max_queued_requests=server.max_queued_requests,
            request_timeout=server.request_timeout,
            max_stream_buffer=server.max_stream_buffer,
            chat_template=spec.chat_template,
            tool_repair_budget=server.tool_repair_budget,
            kind=spec.kind,
            max_images_per_request=server.max_images_per_request,
        )


def chat_template_of(configured: str | None, description: ModelDescription) -> tuple[str | None, str | None]:
    """(template, where it came from): the models file's, else the model's own, else the one
    Argosy ships for its family (Gemma's base GGUF has none), else none."""
    if configured:
        return configured, "models file"
    if description.chat_template:
        return description.chat_template, "model"
    shipped = builtin_template(description.architecture)
    if shipped is not None:
        return shipped[1], f"built-in ({shipped[0]})"
    return None, None


# -- one served generation model ------------------------------------------------------------


class ModelService:
    """One loaded generation model: identity, chat template, sampling defaults, and the way
    to its engine. `on_release` is called as each of its generations ends (the registry
    counts them, so a model is unloaded only when none runs)."""

    def __init__(
        self,
        model_id: str,
        client: EngineClient,
        options: ServiceOptions | None = None,
        *,
        sessions: SessionRecorder | None = None,
        created: int | None = None,
    ) -> None:
        self.model_id = model_id
        self.client = client
        self.options = options or ServiceOptions()
        self.created = created if created is not None else int(time.time())
        self.sessions = sessions
        self.on_start: Callable[[], Callable[[], None]] | None = None  # the registry's lease
        # generations started and not yet closed (weak: one built but never run is not held)
        self.live_streams: weakref.WeakSet[CoreStream] = weakref.WeakSet()
        description = client.description
        self.description = description
        self._model_defaults = ModelSamplingDefaults.from_generation_config(description.generation_config)
        if self._model_defaults.ignored:
            log.warning(
                "generation_config.json values ignored (malformed): %s",
                ", ".join(self._model_defaults.ignored),
            )
        self._template: ChatTemplate | None = None
        self._template_error: ArgosyError | None = None
        self._chat_profile: ChatProfile | None = None
        template, self.template_source = chat_template_of(self.options.chat_template, description)
        if template:
            try:
                self._template = ChatTemplate(
                    template,
                    bos_token=description.bos_token,
                    eos_token=description.eos_token,
                )
            except ArgosyError as exc:
                log.warning("%s", exc.message)
                self._template_error = exc
        if self._template is not None:
            self._chat_profile = ChatProfile(self._template, description.tokenizer)
        self._token_texts = TokenTexts(description.tokenizer)
        self.fim = fim_dialect(description.tokenizer)  # None: no fill-in-the-middle tokens
        self.system_fingerprint = system_fingerprint(model_id, description)
        self._ids = itertools.count()
        self.admission = AdmissionQueue(self.options.max_queued_requests)

    # -- state ---------------------------------------------------------------------------
    @property
    def speculation_enabled(self) -> bool:
        return self.options.speculative != "none"

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    def shutdown(self) -> None:
        self.client.shutdown()

    def require_engine(self) -> EngineClient:
        if not self.client.is_alive:
            raise EngineDeadError(f"The engine of {self.model_id!r} stopped: {self.client.dead_error}")
        return self.client

    def arriving(self) -> Arrival:
        """A generation request on its way to the engine (see AsyncEngine.arriving)."""
        return self.client.arriving() if self.client.is_alive else Arrival()

    def model_info(self, state: str = "loaded") -> ModelInfo:
        description = self.description
        # live: a background compile finishes while the model serves
        stats = self.client.stats() if self.client.is_alive else None
        compile_status = stats.compile_status if stats is not None else None
        return ModelInfo(
            id=self.model_id,
            created=self.created,
            kind=self.options.kind,
            state=state if self.client.is_alive else "dead",
            is_loaded=True,
            context_length=description.context_length,
            architecture=description.architecture,
            dtype=description.dtype,
            quantization=description.quantization,
            has_chat_template=self._template is not None,
            sampling_defaults=effective_defaults(
                self.options.operator_sampling,
                self._model_defaults,
                speculation_enabled=self.speculation_enabled,
            ),
            speculative=self.options.speculative,
            weights=description.weights,
            compiled_decode=compile_status == "ready" if compile_status else description.compiled_decode,
            compile_status=compile_status,
            compiled_graphs=stats.compiled_graphs if stats is not None else None,
            kernels=description.kernels,
            deterministic=description.deterministic,
            has_thinking=self._chat_profile is not None and self._chat_profile.has_reasoning,
            reasoning_effort_levels=(
                self._chat_profile.reasoning_effort_levels() if self._chat_profile is not None else None
            ),
            has_tools=self._chat_profile is not None,
            memory_bytes=description.memory_bytes,
            kv_cache=kv_cache_info(description),
            accepts_images=description.accepts_images,
            tensor_formats=description.tensor_formats,
            chat_template_source=self.template_source if self._template is not None else None,
            has_fim=self.fim is not None,
            # embeddings from this chat model (core/embedding_service.py's ChatEmbedder)
            dimensions=description.hidden_size if self.can_pool else None,
            pooling="mean" if self.can_pool else None,
        )

    @property
    def can_pool(self) -> bool:
        """Its engine computes embeddings (mean-pooled hidden states): a local one does."""
        return isinstance(self.client, PoolingEngineClient) and self.description.hidden_size is not None

    def engine_stats(self) -> tuple[EngineStats, int]:
        """(engine counters, requests in flight through the engine client)."""
        engine = self.require_engine()
        return engine.stats(), engine.num_in_flight()

    def nodes(self) -> list[NodeReport] | None:
        """A fleet model's nodes (None: one local engine)."""
        return self.client.report() if isinstance(self.client, NodeReporting) else None

    async def compile_grammar(self, spec: GrammarSpec, param: str | None) -> None:
        """Compile `spec` where the engine runs (cached there); a 400 naming `param` if it cannot."""
        await self.require_engine().compile_grammar(spec, param)

    # -- prompts -------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """A raw prompt's token ids, with the BOS the model's tokenizer config asks for."""
        return self.description.encode(text)

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

    def encode_fim(self, prefix: str, suffix: str, mode: str | None = None) -> tuple[list[int], list[int]]:
        """A fill-in-the-middle prompt in the model's own FIM tokens (argosy/chat/fim.py), in
        `mode`'s layout where it honours it, and the FIM end markers to stop at; a 400 naming
        `suffix` where the model has none."""
        if self.fim is None:
            raise InvalidRequestError(
                f"Model '{self.model_id}' has no fill-in-the-middle tokens, so 'suffix' cannot be served "
                "(a code model with FIM tokens, or a satellite model configured for it, can).",
                param="suffix",
                code="fim_unsupported",
            )
        description = self.description
        bos = description.bos_token_id if description.add_bos_token else None
        ids = self.fim.prompt_ids(prefix, suffix, bos, mode)
        return ids, list(self.fim.stop_ids)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of template-rendered text (no special tokens added: it writes its own)."""
        tokenizer = self.description.tokenizer
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (what the model saw)."""
        text: str = self.description.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text

    # -- generation ----------------------------------------------------------------------
    def start(self, request: CoreRequest) -> CoreStream:
        """Resolve and check everything for every choice; raise before the engine is touched."""
        engine = self.require_engine()
        description = self.description
        if request.lora_ids is not None:  # llama.cpp's per-request choice, by adapter id
            request.adapter, request.adapter_scale = adapter_by_id(engine, request.lora_ids)
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
                        self.options.operator_sampling,
                        self._model_defaults,
                        context_length=description.context_length,
                        prompt_len=len(prompt_ids),
                        speculation_enabled=self.speculation_enabled,
                    )
                    if request.sampling.seed is not None and j > 0:
                        # Reproducible, but the n samples of one prompt differ from each other.
                        params.seed = _offset_seed(request.sampling.seed, j)
                    params.batch_invariant = request.batch_invariant
                    params.lora, params.lora_scale = request.adapter, request.adapter_scale
                    engine.validate(prompt_ids, params, request.qos)
                    choices.append(
                        ChoiceState(
                            index=len(choices),
                            prompt_index=prompt_index,
                            prompt_ids=prompt_ids,
                            params=params,
                            echo=request.echo,
                            tokenizer=description.tokenizer,
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
        ticket = self.admission.admit()  # last but one: a refused request holds no place
        stream = CoreStream(
            engine,
            request,
            choices,
            self.model_id,
            f"gen-{next(self._ids)}",
            ticket=ticket,
            record=record,
            timeout_s=self.options.request_timeout,
            max_buffered=self.options.max_stream_buffer,
        )
        if self.on_start is not None:
            stream.on_close.append(self.on_start())
        self.live_streams.add(stream)
        stream.on_close.append(lambda: self.live_streams.discard(stream))
        return stream

    def abort_streams(self, error: ArgosyError) -> int:
        """Abort every live generation with `error` (CoreStream.abort); how many were stopped."""
        return sum(stream.abort(error) for stream in list(self.live_streams))


def system_fingerprint(model_id: str, description: ModelDescription) -> str:
    """What the numerics of `model_id`'s answers depend on, hashed as OpenAI's
    `system_fingerprint` ("fp_" + 10 hex digits): Argosy's version, the model and its
    architecture, dtype, the file's quantization, how the weights are held and computed
    (`weights`: int4 / int8 / bf16, packed or not), compiled decode, and the kernel path
    (native ops, AMX). The same configuration on the same machine gives the same fingerprint
    across requests and restarts; a different --quantization, --compile or --native-ops a
    different one."""
    facts = [
        __version__,
        model_id,
        description.name,
        description.architecture,
        description.dtype,
        description.quantization,
        description.weights,
        description.compiled_decode,
        description.kernels,
    ]
    digest = hashlib.sha256(json.dumps(facts).encode()).hexdigest()
    return f"fp_{digest[:10]}"


def _offset_seed(seed: int, offset: int) -> int:
    shifted = (seed + offset) % _SEED_RANGE
    return shifted - _SEED_RANGE if seed < 0 and shifted >= 2**63 else shifted
