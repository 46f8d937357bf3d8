"""A loaded engine's description (engine.outputs.ModelDescription): its model, numerics,
kernels, memory and KV cache, as the dialects' model listings report them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from argosy.engine.outputs import ModelDescription
from argosy.models.build import model_memory_bytes
from argosy.models.gguf_config import GGUF_TENSOR_TYPES_KEY, tensor_formats
from argosy.ops.native import native_ops_path
from argosy.runner.kv_cache import kv_bytes_per_block, kv_bytes_per_token

if TYPE_CHECKING:
    from argosy.engine.llm_engine import LLMEngine


def describe_engine(engine: LLMEngine) -> ModelDescription:
    """What /v1/models, /api/show and the console say of a loaded chat model."""
    source = engine.source
    kv_bytes = engine.num_blocks * kv_bytes_per_block(
        engine.model.config.num_layers,
        engine.config.block_size,
        engine.model.config.num_kv_heads,
        engine.model.config.head_dim,
        engine.kv_dtype,
    )
    return ModelDescription(
        name=source.name,
        architecture=source.architecture,
        dtype=str(engine.dtype).removeprefix("torch."),
        context_length=engine.max_model_len,
        vocab_size=engine.vocab_size,
        tokenizer=source.tokenizer,
        chat_template=source.chat_template,
        bos_token=source.bos_token,
        eos_token=source.eos_token,
        bos_token_id=source.bos_token_id,
        eos_token_ids=tuple(source.eos_token_ids),
        add_bos_token=source.add_bos_token,
        generation_config=dict(source.generation_config),
        quantization=source.gguf_file_type,
        weights=engine.weights,
        compiled_decode=engine.config.compile != "off",  # asked for (live: stats().compile_status)
        memory_bytes=model_memory_bytes(engine.model) + kv_bytes,
        kernels="triton-cuda" if engine.device.startswith("cuda") else native_ops_path(engine.invariant),
        deterministic=engine.deterministic,
        tensor_formats=tensor_formats(source.hf_config.get(GGUF_TENSOR_TYPES_KEY)),
        hidden_size=engine.model.config.hidden_size,
        kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
        kv_bytes_per_token=kv_bytes_per_token(
            engine.model.config.num_layers,
            engine.model.config.num_kv_heads,
            engine.model.config.head_dim,
            engine.kv_dtype,
        ),
        kv_capacity_tokens=engine.num_blocks * engine.config.block_size,
        accepts_images=engine.vision is not None,
    )
