"""Architecture name (config.json `architectures[0]`) -> the module that builds it."""

from __future__ import annotations

import importlib
from typing import Protocol

from torch import nn

from argosy.errors import ModelLoadError
from argosy.ops.attention import AttentionBackend

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "argosy.models.llama",
    "MistralForCausalLM": "argosy.models.llama",
    "Qwen2ForCausalLM": "argosy.models.qwen2",
    "Qwen3ForCausalLM": "argosy.models.qwen3",
    "Gemma3ForCausalLM": "argosy.models.gemma3",
}


class ModelBuilder(Protocol):
    def __call__(self, hf_config: dict, backend: AttentionBackend | None = None) -> nn.Module: ...


def builder_for(architecture: str) -> ModelBuilder:
    module_name = ARCHITECTURES.get(architecture)
    if module_name is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"architecture {architecture!r} is not supported (supported: {known})")
    builder: ModelBuilder = importlib.import_module(module_name).build
    return builder
