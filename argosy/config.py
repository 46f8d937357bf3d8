"""Configuration dataclasses, built once at the edge (cli.py) and passed down.

Nothing below cli.py reads the environment. Every value is validated in __post_init__.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from argosy.errors import InvalidRequestError

QOS_CLASSES = ("interactive", "background", "inline")


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2"  # a registered name, a GGUF file or a Hugging Face folder
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    kv_cache_memory: int = 512 * 1024 * 1024  # bytes for K and V across all layers
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunk bound)
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # None: leave torch's default
    cache_dir: str | None = None  # where converted GGUF models are kept
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise InvalidRequestError(
                f"dtype must be auto, bfloat16, float32 or float16, got {self.dtype!r}", "dtype"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(
                f"block_size must be a power of two, got {self.block_size}", "block_size"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2", "max_model_len")
        if self.kv_cache_memory < 1:
            raise InvalidRequestError("kv_cache_memory must be positive", "kv_cache_memory")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1", "max_num_seqs")
        if self.max_num_batched_tokens < self.block_size:
            raise InvalidRequestError(
                "max_num_batched_tokens must be at least block_size", "max_num_batched_tokens"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError("num_threads must be at least 1", "num_threads")


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


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_body_bytes: int = 25 * 1024 * 1024
    operator_sampling: OperatorSampling = field(default_factory=OperatorSampling)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0..65535, got {self.port}", "port")
