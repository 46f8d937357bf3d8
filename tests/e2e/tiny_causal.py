"""A tiny random causal LM folder on SmolLM2's real tokenizer, for servers whose model's
quality does not matter (FIM layouts, a yes/no reranker): every weight drawn N(0, 0.3), norms
around 1, so the logits are far from ties and transformers' float32 is a sharp reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def write_tiny_causal_lm(
    folder: Path, architecture: str, seed: int, special_tokens: list[str] | None = None, **config: Any
) -> None:
    """Write `architecture` ("llama" or "qwen3") into `folder` with SmolLM2's tokenizer, plus
    `special_tokens`; `config` overrides the tiny shape's fields."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from argosy.models.gguf_config import read_gguf_metadata
    from argosy.models.gguf_convert import open_gguf
    from argosy.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config
    from argosy.models.loader import MODEL_REGISTRY

    metadata = read_gguf_metadata(open_gguf(MODEL_REGISTRY["smollm2"]()))
    tokenizer = build_tokenizer(metadata)
    if special_tokens:
        assert tokenizer.add_special_tokens(special_tokens) == len(special_tokens)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = build_tokenizer_config(metadata) | {"add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[architecture]
    shape = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id("<|im_start|>"),
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
    )
    torch.manual_seed(seed)
    model = model_class(config_class(**(shape | config))).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3)
            if name.endswith("norm.weight"):
                param.add_(1.0)
    model.save_pretrained(folder)
