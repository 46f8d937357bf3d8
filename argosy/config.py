"""Configuration dataclasses, built once at the edge (cli.py) and passed down.

Nothing below cli.py reads the environment. Every value is validated in __post_init__.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace

from argosy.errors import InvalidRequestError
from argosy.ops.devices import check_device_name

QOS_CLASSES = ("interactive", "background", "inline")
KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "int8")


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2"  # a registered name, a GGUF file or a Hugging Face folder
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    # auto: int4 from a GGUF's own Q4 blocks where the file has them, else the float weights
    quantization: str = "auto"  # auto | none | int4 | int8
    # cpu | cuda | cuda:N | auto (CUDA where torch sees a GPU, else the CPU). On CUDA the layers
    # are Triton kernels (ops/gpu_layers.py) and the KV cache is sized from free GPU memory
    device: str = "cpu"
    # on CUDA: the share of the GPU's memory this engine may hold (weights, activations and
    # the KV cache, which takes what the other two leave); --kv-cache-memory is the CPU's
    gpu_memory_fraction: float = 0.85
    # on | wait | off: torch.compile the decode step. on: in the background, at low priority,
    # while steps run eagerly; the engine switches to the graphs between steps once they are all
    # built (the same tokens: the invariant mode's compiled step gives the eager step's bits).
    # wait: before the engine takes requests (the first steps already compiled). Either falls
    # back to eager steps if compiling fails.
    compile: str = "on"
    # on | off: Argosy's C++ ops (argosy/ops/csrc), built on first use; off: the Python ops.
    # Process-wide (argosy/process.py), set from the first model's config.
    native_ops: str = "on"
    # auto | fast | invariant. invariant: a request's tokens and logprobs are bit-identical
    # whatever runs beside it, however its prompt is split into chunks and whether its prefix
    # came from the cache (int4/int8 layers on the invariant kernels, csrc/iq_linear.cpp, for
    # every row count; every token's attention as a decode row of one native kernel,
    # csrc/iq_attention.cpp; a float32 residual stream; the compiled step rounding as eager
    # does). Needs the native ops and quantized weights; asked for where it cannot run, it is
    # refused at load. auto (the default): invariant where the weights are quantized (a GGUF's
    # Q4 blocks) and it can run, else fast (models/build.py resolve_numerics).
    numerics: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    # bytes for K and V across all layers. The pool's pages become resident as blocks are first
    # used, so a busy server's RSS grows to about its weights + this: 192 MiB holds 8,730 tokens
    # of SmolLM2 (one request of its whole 8,192-token context, or 32 requests of 270 tokens
    # before preemption; llama-server's default is 4,096)
    kv_cache_memory: int = 192 * 1024 * 1024
    # auto | fp16 | bf16 | int8: the KV cache's element. auto: the kernels' own (the invariant
    # attention's fp16, else the model's dtype); int8: llama.cpp's q8_0 (codes and an fp16 scale
    # per 32 dims: 0.53x fp16's bytes, so ~1.9x the tokens in kv_cache_memory), on the invariant
    # attention kernel only (csrc/iq_attention.cpp), refused at load elsewhere
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunk bound; measured:
    # a 1,000-token prompt prefills at ~2,900 tok/s in one chunk vs ~2,200 in two of 512)
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # None: leave torch's default
    cache_dir: str | None = None  # where converted GGUF models are kept
    seed: int = 0
    # Speculative decoding (argosy/runner/spec_decode.py): "none" | "ngram" (prompt lookup:
    # draft the tokens that followed the latest earlier occurrence of the last n tokens).
    speculative: str = "none"
    # most draft tokens verified per step and sequence: 3 keeps a single stream's verify step
    # at 4 rows, the int4 side of the weights (bench/spec.py, int4 + compiled, rewrite a
    # passage: k=3 1.77x plain, k=6 1.14x, since 7 rows run on the bf16 side)
    num_speculative_tokens: int = 3
    ngram_min: int = 2  # shortest suffix n-gram looked up (tried longest first)
    ngram_max: int = 4
    # drafts only in steps with at most this many decoding requests: draft rows are nearly free
    # while a step is bound by reading the weights, not once it is bound by compute (measured
    # on 2 CPU cores: 8 concurrent rewrites at 40% acceptance ran at 0.65x without this cap)
    spec_max_decodes: int = 4
    # a smaller model of the same tokenizer that drafts for this one (runner/draft_model.py):
    # a registered name, a .gguf file or a folder; with speculative "ngram" the two chain
    draft_model: str | None = None
    # the draft model proposes among the first draft_vocab token ids only (0: all): its output
    # head cut to those rows (FR-Spec's idea; a byte-level BPE numbers its tokens in merge order,
    # roughly by frequency). Qwen2.5's 151,936-row head is ~1/3 of the 0.5B's bytes a step; the
    # first 65,536 ids hold 98% of the tokens of a passage and of code (bench/workloads.py, our
    # source), and the target verifies every proposal, so its tokens do not change
    draft_vocab: int = 65536
    # LoRA adapters (argosy/engine/adapters.py): (name, path) served from the start; enable_lora
    # wraps the projections even without one, so that /v1/load_lora_adapter can add them later
    loras: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident at once (least recently used beyond: read again on use)
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise InvalidRequestError(
                f"dtype must be auto, bfloat16, float32 or float16, got {self.dtype!r}", "dtype"
            )
        if self.quantization not in ("none", "int4", "int8", "auto"):
            raise InvalidRequestError(
                f"quantization must be none, int4, int8 or auto, got {self.quantization!r}", "quantization"
            )
        if self.compile not in ("off", "on", "wait"):
            raise InvalidRequestError(f"compile must be on, wait or off, got {self.compile!r}", "compile")
        if self.numerics not in ("auto", "fast", "invariant"):
            raise InvalidRequestError(
                f"numerics must be auto, fast or invariant, got {self.numerics!r}", "numerics"
            )
        check_device_name(self.device)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise InvalidRequestError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}",
                "gpu_memory_fraction",
            )
        if self.native_ops not in ("off", "on"):
            raise InvalidRequestError(f"native_ops must be off or on, got {self.native_ops!r}", "native_ops")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(
                f"block_size must be a power of two, got {self.block_size}", "block_size"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2", "max_model_len")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
        if self.kv_cache_memory < 1:
            raise InvalidRequestError("kv_cache_memory must be positive", "kv_cache_memory")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1", "max_num_seqs")
        if self.max_loras < 1:
            raise InvalidRequestError("max_loras must be at least 1", "max_loras")
        if self.max_lora_rank < 1:
            raise InvalidRequestError("max_lora_rank must be at least 1", "max_lora_rank")
        if self.max_num_batched_tokens < self.block_size:
            raise InvalidRequestError(
                "max_num_batched_tokens must be at least block_size", "max_num_batched_tokens"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError("num_threads must be at least 1", "num_threads")
        if self.speculative not in ("none", "ngram"):
            raise InvalidRequestError(
                f"speculative must be none or ngram, got {self.speculative!r}", "speculative"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}",
                "num_speculative_tokens",
            )
        if self.draft_vocab < 0:
            raise InvalidRequestError(
                f"draft_vocab must be 0 (all) or more, got {self.draft_vocab}", "draft_vocab"
            )
        if self.spec_max_decodes < 1:
            raise InvalidRequestError("spec_max_decodes must be at least 1", "spec_max_decodes")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(
                f"ngram_min must be at least 1 and at most ngram_max, got {self.ngram_min}..{self.ngram_max}",
                "ngram_min",
            )

    @property
    def speculation_enabled(self) -> bool:
        return self.speculation_method != "none"

    @property
    def speculation_method(self) -> str:
        """What drafts: "none", "ngram", "draft" (a draft model) or "ngram+draft" (chained)."""
        methods = [m for m in (self.speculative, "draft" if self.draft_model else "none") if m != "none"]
        return "+".join(methods) or "none"


@dataclass(slots=True)
class OperatorSampling:
    """Operator sampling flags (SPEC §3 'operator' level); None = not set."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    spec_max_temperature: float | None = None

    def __post_init__(self) -> None:
        # The same ranges a request is held to: /v1/models advertises these values, and a
        # client sending them back must not be refused (SPEC §3 rule 7).
        checks: dict[str, tuple[float | int | None, bool, str]] = {
            "temperature": (self.temperature, _in(self.temperature, 0.0, 2.0), "in [0, 2]"),
            "top_p": (self.top_p, self.top_p is None or 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            "top_k": (self.top_k, self.top_k is None or self.top_k >= 0, ">= 0 (0 disables it)"),
            "min_p": (self.min_p, _in(self.min_p, 0.0, 1.0), "in [0, 1]"),
            "repetition_penalty": (
                self.repetition_penalty,
                self.repetition_penalty is None or self.repetition_penalty > 0.0,
                "> 0",
            ),
            "max_tokens": (self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            "spec_max_temperature": (
                self.spec_max_temperature,
                _in(self.spec_max_temperature, 0.0, 2.0),
                "in [0, 2]",
            ),
        }
        for name, (value, is_valid, expected) in checks.items():
            if not is_valid:
                raise InvalidRequestError(f"{name} must be {expected}, got {value}", name)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _in(value: float | None, low: float, high: float) -> bool:
    return value is None or low <= value <= high


MODEL_KINDS = ("chat", "embedding", "rerank", "transcription", "speech", "image", "music")


@dataclass(slots=True)
class ModelSpec:
    """One configured model (`--model`, repeatable, or a `--models` TOML file). Fields left
    None take the engine flags' values (`engine_config`)."""

    id: str  # what clients name
    source: str  # a registered name (smollm2, minilm), a .gguf file or a model folder
    kind: str = "chat"  # chat | embedding | rerank | transcription | speech | image | music
    aliases: tuple[str, ...] = ()
    quantization: str | None = None
    compile: str | None = None
    max_model_len: int | None = None
    keep_alive: float | None = None  # seconds idle before it is unloaded; None: the server's
    pinned: bool = False  # loaded at start-up and never unloaded to make room
    sampling: OperatorSampling | None = None  # this model's operator sampling defaults
    chat_template: str | None = None  # a Jinja chat template overriding the model's (or the built-in one)
    # a smaller chat model of the same tokenizer that serves this one's fill-in-the-middle
    # requests (`suffix`); routed there with QoS inline
    satellite: str | None = None
    draft: str | None = None  # a draft model for speculative decoding (as --draft-model)
    kv_cache_dtype: str | None = None  # as --kv-cache-dtype
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, path), as --lora

    def __post_init__(self) -> None:
        if not self.id.strip():
            raise InvalidRequestError("a model id must not be empty", "model")
        if not self.source.strip():
            raise InvalidRequestError(f"model {self.id!r}: its source must not be empty", "model")
        if self.kind not in MODEL_KINDS:
            raise InvalidRequestError(
                f"model {self.id!r}: kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}", "model"
            )
        if self.keep_alive is not None and self.keep_alive < 0:
            raise InvalidRequestError(f"model {self.id!r}: keep_alive must be >= 0", "model")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The engine config this model loads with: `base` with this model's overrides."""
        overrides: dict[str, object] = {"model": self.source}
        for name in ("quantization", "compile", "max_model_len", "kv_cache_dtype"):
            value = getattr(self, name)
            if value is not None:
                overrides[name] = value
        if self.draft is not None:
            overrides["draft_model"] = self.draft
        if self.adapters:
            overrides["loras"] = (*base.loras, *self.adapters)
        return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the model id clients see; None: the --model value
    max_body_bytes: int = 25 * 1024 * 1024
    log_level: str = "info"
    # Sessions (SPEC §5): one SQLite file under data_dir; '~' is expanded at start-up (cli.py).
    data_dir: str = "~/.local/share/argosy"
    session_ttl: float = 30 * 86400.0  # seconds a session is kept after its last update
    session_max_bytes: int | None = None  # cap on stored event bytes; None: no cap
    # Admission (SPEC §6)
    max_queued_requests: int = 256  # requests waiting to start, beyond which a 503 answers
    request_timeout: float = 600.0  # wall-clock seconds per generation, then finish "length"
    # engine outputs (about a token each) a streaming client may leave unread before its
    # generation is stopped ("length", x-argosy-degraded: slow_reader): bounds its memory
    max_stream_buffer: int = 4096
    # seconds without a frame before an OpenAI SSE stream sends a `: keep-alive` comment (a long
    # prefill, a queue): proxies with idle timeouts keep the stream; 0: off
    sse_keepalive_s: float = 15.0
    # `auto` tool calls whose arguments fail their tool's schema written again under the
    # schema's grammar, at most this many per request (a request's `tool_repair_budget`
    # overrides it); 0: none, such a call comes back as text named `tool_call_invalid`
    tool_repair_budget: int = 1
    max_images_per_request: int = 8  # images one chat request may hold (a VLM's; more: a 400)
    # Model registry (argosy/core/registry.py)
    max_loaded_models: int | None = None  # None: no limit; past it the least recently used goes
    max_loaded_memory: int | None = None  # bytes of loaded models (weights + KV) before LRU unloads
    max_concurrent_loads: int = 1  # model loads running at once
    model_load_timeout: float = 120.0  # seconds a request waits for its model, then 503
    keep_alive: float | None = None  # seconds a model may sit idle before it is unloaded; None: forever
    # Graceful drain (SIGTERM / SIGINT): seconds in-flight requests may run on, then aborted
    shutdown_grace: float = 30.0
    # The gate (argosy/api/gate.py, argosy/core/keys.py): keys, limits, CORS, events
    api_key: list[str] = field(default_factory=list)  # repeatable; named key-1, key-2...
    api_key_file: str | None = None  # one key per line (keeps keys out of the process listing)
    api_keys: str | None = None  # keys.toml: keys with per-key policy
    admin_key: list[str] = field(default_factory=list)  # repeatable; named admin-1...: may load adapters
    insecure: bool = False  # allow a non-loopback --host with no key
    rate_limit_per_minute: float | None = None  # per client address; None: no limit
    burst: float | None = None  # the per-address bucket's depth (default: one minute's rate)
    rate_limit_loopback: bool = False  # also limit loopback clients (exempt by default)
    trusted_proxies: list[str] = field(default_factory=list)  # addresses / CIDRs whose X-Forwarded-For counts
    allowed_origins: list[str] = field(default_factory=list)  # CORS; none: no CORS headers at all
    max_small_body_bytes: int = 1024 * 1024  # routes that generate nothing: 413 past it
    # Audio (argosy/audio/): uploads get their own, larger limit; sync work is capped in length
    max_audio_body_bytes: int = 100 * 1024 * 1024  # transcription uploads: 413 past it
    max_audio_seconds: float = 1800.0  # audio one transcription request may hold; longer: a job
    max_speech_chars: int = 4096  # text one speech request may hold (OpenAI's limit); longer: a job
    max_audio_jobs: int = 16  # audio jobs waiting or running; past it a new one gets 503
    max_rerank_documents: int = 1000  # documents one rerank request (pairs one score request) may hold
    events_log: str | None = None  # request events as JSON lines (rotated)
    events_log_max_bytes: int = 64 * 1024 * 1024
    events_ring_size: int = 1000  # the last N requests kept in memory (the console reads them)
    console_body_bytes: int = 32 * 1024  # per side of a listed request, kept for the console; 0: none
    operator_sampling: OperatorSampling = field(default_factory=OperatorSampling)

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key or self.api_key_file or self.api_keys or self.admin_key)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0..65535, got {self.port}", "port")
        if self.max_body_bytes < 1:
            raise InvalidRequestError("max_body_bytes must be positive", "max_body_bytes")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidRequestError("served_model_name must not be empty", "served_model_name")
        if not self.data_dir.strip():
            raise InvalidRequestError("data_dir must not be empty", "data_dir")
        if self.session_ttl <= 0:
            raise InvalidRequestError("session_ttl must be positive", "session_ttl")
        if self.session_max_bytes is not None and self.session_max_bytes < 1:
            raise InvalidRequestError("session_max_bytes must be positive", "session_max_bytes")
        if self.max_queued_requests < 0:
            raise InvalidRequestError("max_queued_requests must be at least 0", "max_queued_requests")
        if self.request_timeout <= 0:
            raise InvalidRequestError("request_timeout must be positive", "request_timeout")
        if self.sse_keepalive_s < 0:
            raise InvalidRequestError("sse_keepalive_s must be >= 0 (0: off)", "sse_keepalive_s")
        if self.tool_repair_budget < 0:
            raise InvalidRequestError("tool_repair_budget must be >= 0 (0: off)", "tool_repair_budget")
        if self.max_stream_buffer < 1:
            raise InvalidRequestError("max_stream_buffer must be at least 1", "max_stream_buffer")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise InvalidRequestError("max_loaded_models must be at least 1", "max_loaded_models")
        if self.max_loaded_memory is not None and self.max_loaded_memory < 1:
            raise InvalidRequestError("max_loaded_memory must be positive", "max_loaded_memory")
        if self.max_concurrent_loads < 1:
            raise InvalidRequestError("max_concurrent_loads must be at least 1", "max_concurrent_loads")
        if self.model_load_timeout <= 0:
            raise InvalidRequestError("model_load_timeout must be positive", "model_load_timeout")
        if self.keep_alive is not None and self.keep_alive < 0:
            raise InvalidRequestError("keep_alive must be >= 0", "keep_alive")
        if self.shutdown_grace < 0:
            raise InvalidRequestError("shutdown_grace must be >= 0", "shutdown_grace")
        if not self.has_keys and not self.insecure and not is_loopback(self.host):
            raise InvalidRequestError(
                f"serving on {self.host} (not loopback) with no API key lets anyone who reaches the "
                "port use every route: set --api-key / --api-key-file / --api-keys, or --insecure",
                "insecure",
            )
        if self.rate_limit_per_minute is not None and self.rate_limit_per_minute <= 0:
            raise InvalidRequestError("rate_limit_per_minute must be positive", "rate_limit_per_minute")
        if self.burst is not None and self.burst < 1:
            raise InvalidRequestError("burst must be at least 1", "burst")
        if self.max_small_body_bytes < 1:
            raise InvalidRequestError("max_small_body_bytes must be positive", "max_small_body_bytes")
        if self.max_audio_body_bytes < 1:
            raise InvalidRequestError("max_audio_body_bytes must be positive", "max_audio_body_bytes")
        if self.max_audio_seconds <= 0:
            raise InvalidRequestError("max_audio_seconds must be positive", "max_audio_seconds")
        if self.max_speech_chars < 1:
            raise InvalidRequestError("max_speech_chars must be at least 1", "max_speech_chars")
        if self.max_audio_jobs < 1:
            raise InvalidRequestError("max_audio_jobs must be at least 1", "max_audio_jobs")
        if self.max_rerank_documents < 1:
            raise InvalidRequestError("max_rerank_documents must be at least 1", "max_rerank_documents")
        if self.events_ring_size < 0:
            raise InvalidRequestError("events_ring_size must be >= 0", "events_ring_size")
        if self.console_body_bytes < 0:
            raise InvalidRequestError("console_body_bytes must be >= 0", "console_body_bytes")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise InvalidRequestError(
                    f"trusted_proxies: {proxy!r} is not an address or CIDR", "trusted_proxies"
                ) from None
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise InvalidRequestError(
                f"log_level must be critical, error, warning, info or debug, got {self.log_level!r}",
                "log_level",
            )
