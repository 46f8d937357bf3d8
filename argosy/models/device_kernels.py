"""The runner's backends by device: a model is built once (its modules, its weights), then its
attention, linears and norms are swapped for the device's own. The CPU keeps what the model
was built with (CPU paged attention, oneDNN / int4 / invariant kernels: models/build.py);
CUDA takes the Triton layers of ops/gpu_layers.py.

On CUDA a GGUF's Q4 blocks stay 4-bit (TritonQ4Linear), every other weight is float on the
fixed-tile matmul; `--quantization int8` is a CPU kernel and is refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from argosy.errors import ModelLoadError
from argosy.models.gemma3 import GemmaRMSNorm
from argosy.models.gguf_quant import INT4_FILE
from argosy.models.llama import Attention, DecoderForCausalLM, RMSNorm
from argosy.models.quantize import FUSED_PARTS, _replace
from argosy.models.source import ModelSource


def apply_cuda_kernels(model: DecoderForCausalLM, source: ModelSource, quantization: str) -> int:
    """Swap every attention backend, projection, head and norm for the Triton layers (on the
    host: `.to(device)` moves them after); returns the number of Q4 projections."""
    from argosy.ops.gpu_layers import TritonLinear, TritonPagedAttention, TritonQ4Linear, TritonRMSNorm

    if quantization == "int8":
        raise ModelLoadError(
            "--quantization int8 runs CPU kernels; on CUDA use auto (a GGUF's Q4 blocks) or none"
        )
    blocks_file = Path(source.weights_dir) / INT4_FILE
    if quantization == "int4" and not blocks_file.exists():
        raise ModelLoadError("int4 uses a GGUF file's own Q4_0/Q4_1 blocks; this model has none (try none)")
    blocks = load_file(str(blocks_file)) if quantization in ("auto", "int4") and blocks_file.exists() else {}
    cfg = model.config
    count = 0
    for i in range(cfg.num_layers):
        for fused, parts in FUSED_PARTS.items():
            path = f"layers.{i}.{fused}"
            current = model.get_submodule(path)
            assert isinstance(current, nn.Linear)
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if all(f"{n}.codes" in blocks for n in names):
                codes, d, m = (
                    torch.cat([blocks[f"{n}.{key}"] for n in names]) for key in ("codes", "d", "m")
                )
                _replace(model, path, TritonQ4Linear(codes, d, m, current.bias))
                count += 1
            else:
                _replace(model, path, TritonLinear(current.weight, current.bias))
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    model.lm_head = TritonLinear(head.weight, head.bias)  # type: ignore[assignment]
    for name, module in list(model.named_modules()):
        if isinstance(module, RMSNorm):
            norm = TritonRMSNorm(module.weight, module.eps, gemma=isinstance(module, GemmaRMSNorm))
            _replace(model, name, norm)
        elif isinstance(module, Attention):
            module.backend = TritonPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return count


# device type -> the swap to run after the model is built and its weights loaded (none: as built)
DEVICE_KERNELS: dict[str, Callable[[DecoderForCausalLM, ModelSource, str], int]] = {
    "cuda": apply_cuda_kernels,
}
