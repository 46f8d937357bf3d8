"""What the engine hands back: plain data, one RequestOutput per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability (log-softmax of the raw logits) and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """An incremental update for one request.

    `new_token_ids` / `new_logprobs` / `text_delta` hold only what is new since the last
    output. `prompt_logprobs` arrives once (first entry None: the first prompt token has
    no prefix). `finish_reason` is "stop" (EOS, stop token or stop string), "length"
    (max_tokens or context full), "abort" (cancelled) or "error".
    """

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    # speculative decoding totals so far; None when the engine does not speculate
    num_spec_proposed: int | None = None  # draft tokens verified
    num_spec_accepted: int | None = None  # draft tokens accepted
    queue_s: float | None = None  # the engine took it -> first scheduled (None: not yet)
    embedding: list[float] | None = None  # a pooling request's vector (float32 values), once finished


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_proposed_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of which accepted
    spec_steps: int = 0  # sequence-steps that verified a draft
    # the compiled decode step: off | compiling | ready (steps run it) | failed (eager) | stopped
    compile_status: str = "off"
    compiled_graphs: int = 0  # graphs built so far (a bench checks none is built while it measures)
    lora_adapters: int = 0  # LoRA adapters served (engine/adapters.py)
    lora_resident: int = 0  # of which in a slot now (--max-loras)
    lora_reads: int = 0  # adapter files read (first loads, and again after an eviction)
    images_encoded: int = 0  # a VLM's images through its vision encoder
    image_cache_hits: int = 0  # images whose features were cached (sent again)

    @property
    def kv_cache_usage(self) -> float:
        used = self.num_total_blocks - self.num_free_blocks
        return used / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What the core needs to know of a loaded generation model: plain data (the tokenizer
    serialises), so a remote engine can hand it over too."""

    name: str  # the source's display name, e.g. "smollm2"
    architecture: str
    dtype: str  # e.g. "bfloat16"
    context_length: int  # the engine's max_model_len
    vocab_size: int
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    generation_config: dict[str, Any]
    quantization: str | None  # the file's own type, e.g. "Q4_1" for a GGUF
    weights: str  # how the projections are held and computed (describe_weights)
    compiled_decode: bool
    memory_bytes: int  # weights and buffers plus the KV pool, as allocated
    kernels: str = "python"  # the ops the steps run: native+amx | native | python (native_ops_path)
    deterministic: bool = False  # --numerics invariant: a request's tokens do not depend on its batch
    tensor_formats: dict[str, str] | None = (
        None  # a GGUF's types per weight role (gguf_config.tensor_formats)
    )
    hidden_size: int | None = None  # the last hidden state's width (a pooled embedding's length)
    kv_cache_dtype: str | None = None  # the KV cache's element: float16 | bfloat16 | int8 (q8_0) ...
    kv_bytes_per_token: int | None = None  # K and V of one token, all layers
    kv_capacity_tokens: int | None = None  # tokens the KV pool holds (blocks x block size)
    accepts_images: bool = False  # a vision-language model (models/llava.py)

    def encode(self, text: str) -> list[int]:
        """A raw prompt's token ids, with the BOS the model's tokenizer config asks for."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids
