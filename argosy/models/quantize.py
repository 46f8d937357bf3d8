"""Swap a decoder's projection layers for weight-only quantized ones (int4 / int8).

The embeddings stay in the model dtype. The output head never goes to 4 bits (a 4-bit head
flipped greedy answers on SmolLM2: shared/notes/cpu-decode-probe.md); with int4 projections
it goes to int8 per channel (`apply_int8_head`), as llama.cpp holds it in 8 bits (Q8_0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from argosy.models.llama import DecoderForCausalLM
from argosy.ops.composite_linear import BatchSwitchLinear, PartsLinear
from argosy.ops.packed_codes import SuperScales
from argosy.ops.quantized_linear import (
    BlockCodes,
    Int4Linear,
    Int8Linear,
    packed_bits,
)

# our fused module -> the HF weights it is made of, in order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


# the projections whose x the invariant kernels take in their fine form (csrc/iq_rows.h: 15-bit
# codes, twice the integer products), besides the output head: where rounding x to 8 bits moves
# the logits most for the fewest products. SmolLM2, 1,024 positions of bench/quality.py, KL to
# the fp32 reference (llama-server 2.15e-3, |dlp| 0.0527): every x at 8 bits 2.14e-3 (|dlp|
# 0.0555); the head fine 1.36e-3 (0.0442); + qkv 8.2e-4 (0.0343); + o_proj instead 1.34e-3; +
# down_proj instead 1.0e-3 (0.0365) at 1.6x qkv's products (4.5x on Qwen2.5's GQA); every
# layer fine 6e-7. q and k's errors reach the attention scores through the softmax.
FINE_LAYERS = ("self_attn.qkv_proj",)


def take_fine_form(model: nn.Module) -> int:
    """Marks FINE_LAYERS' invariant projections (a fused layer split by format: each part) to
    take x in the fine form; returns how many."""
    count = 0
    for name, module in model.named_modules():
        layer = name.rsplit(".parts.", 1)[0]
        if layer.endswith(FINE_LAYERS) and isinstance(module, (Int4Linear, Int8Linear)) and module.invariant:
            module.fine = True
            count += 1
    return count


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path), attr, module)


def apply_int4(
    model: DecoderForCausalLM,
    blocks: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    max_int4_rows: int = 0,
    invariant: bool = False,
) -> int:
    """Use the file's 4-bit blocks wherever every part of a projection has them; returns the
    number of layers swapped (the rest keep their float weights). With max_int4_rows > 0
    the float layer is kept too and used for steps of more rows (BatchSwitchLinear)."""
    count = 0
    for i in range(model.config.num_layers):
        for fused, parts in FUSED_PARTS.items():
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not all(f"{n}.codes" in blocks for n in names):
                continue
            path = f"layers.{i}.{fused}"
            current = model.get_submodule(path)
            assert isinstance(current, nn.Linear)
            codes, d, m = (torch.cat([blocks[f"{n}.{key}"] for n in names]) for key in ("codes", "d", "m"))
            int4 = Int4Linear(codes, d, m, current.bias, dtype, invariant=invariant)
            _replace(model, path, BatchSwitchLinear(int4, current, max_int4_rows) if max_int4_rows else int4)
            count += 1
    return count


def block_codes_of(blocks: Mapping[str, torch.Tensor], names: list[str]) -> BlockCodes | None:
    """The weights `names` as one BlockCodes (a fused layer's parts stacked), or None if one
    of them has no codes in the file (argosy-blocks.safetensors)."""
    if not all(f"{n}.codes" in blocks for n in names):
        return None
    return BlockCodes.cat([_block_codes(blocks, n) for n in names])


def _block_codes(blocks: Mapping[str, torch.Tensor], name: str) -> BlockCodes:
    super_scales = None
    if f"{name}.sc" in blocks:  # a K-quant's own scales: its codes held at their bits
        super_scales = SuperScales(
            blocks[f"{name}.sc"], blocks[f"{name}.d"], blocks.get(f"{name}.mn"), blocks.get(f"{name}.dmin")
        )
    return BlockCodes(
        blocks[f"{name}.codes"], blocks[f"{name}.scales"], blocks.get(f"{name}.mins"), super_scales
    )


def runs_of_one_form(parts: list[BlockCodes]) -> list[BlockCodes]:
    """A fused layer's parts, consecutive parts of one form stacked: a Q4_K_M file's q and k
    (Q4_K) apart from its v (Q6_K), each then held at its own bits (a stack of the two forms
    would be int8 codes with float32 scales)."""
    runs: list[list[BlockCodes]] = []
    for part in parts:
        key = (part.form(), packed_bits(part))
        if runs and (runs[-1][0].form(), packed_bits(runs[-1][0])) == key:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [BlockCodes.cat(run) for run in runs]


def apply_blocks(model: DecoderForCausalLM, blocks: Mapping[str, torch.Tensor], dtype: torch.dtype) -> int:
    """The file's own codes (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) on the invariant kernels for
    every float projection whose parts all have them, held at the file's bits where a packed
    kernel serves the form (packed_codes.py), else as int8; a fused layer whose parts differ in
    form becomes one layer a form (PartsLinear). Returns the number swapped."""
    count = 0
    for i in range(model.config.num_layers):
        for fused, parts in FUSED_PARTS.items():
            path = f"layers.{i}.{fused}"
            current = model.get_submodule(path)
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not isinstance(current, nn.Linear) or not all(f"{n}.codes" in blocks for n in names):
                continue
            runs = runs_of_one_form([_block_codes(blocks, n) for n in names])
            layers: list[nn.Module] = []
            start = 0
            for run in runs:
                rows = run.codes.shape[0]
                bias = None if current.bias is None else current.bias[start : start + rows]
                layers.append(Int8Linear(None, bias, dtype, invariant=True, blocks=run))
                start += rows
            _replace(model, path, layers[0] if len(layers) == 1 else PartsLinear(layers))
            count += 1
    return count


def apply_int8(
    model: DecoderForCausalLM,
    dtype: torch.dtype,
    invariant: bool = False,
    rows_of: Callable[[list[str]], Callable[[int, int], torch.Tensor] | None] | None = None,
) -> int:
    """Every float projection to int8; `rows_of(hf_names)`: where to read a fused layer's
    weight rows as the files hold them, if anywhere (Int8Linear's `weight_rows`)."""
    count = 0
    for i in range(model.config.num_layers):
        for fused, parts in FUSED_PARTS.items():
            path = f"layers.{i}.{fused}"
            current = model.get_submodule(path)
            if isinstance(current, nn.Linear):
                rows = rows_of([f"model.layers.{i}.{p}.weight" for p in parts]) if rows_of else None
                int8 = Int8Linear(current.weight, current.bias, dtype, invariant=invariant, weight_rows=rows)
                _replace(model, path, int8)
                count += 1
    return count


def apply_int8_head(
    model: DecoderForCausalLM,
    dtype: torch.dtype,
    max_int8_rows: int = 0,
    *,
    invariant: bool = False,
    float_output: bool = False,
    weight_rows: Callable[[int, int], torch.Tensor] | None = None,
    blocks: BlockCodes | None = None,
) -> None:
    """An int8 (per output channel) copy of the output head, for steps of at most
    max_int8_rows rows when given (the float head serves the rest): at one row it reads half
    the bytes of bf16 (0.95 vs 1.34 ms for SmolLM2's 49152 x 576 head, 2 threads), but int8's
    kernel slows with rows (3.3 ms at 8). A tied head keeps the embeddings in float.
    `float_output`: logits in float32 where the invariant kernels serve the head, x in their
    fine form (the head's rounding of x is what moves the logits most: bench/quality.py);
    `weight_rows`: the head's rows as the files hold them, `blocks`: its own codes (Int8Linear)."""
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    # a file's codes are within [-127, 127] (gguf_quant.block_codes keeps float weights otherwise)
    int8 = Int8Linear(
        head.weight,
        head.bias,
        dtype,
        invariant=invariant,
        float_output=float_output,
        weight_rows=weight_rows,
        blocks=blocks,
        fine=float_output,
    )
    model.lm_head = BatchSwitchLinear(int8, head, max_int8_rows) if max_int8_rows else int8  # type: ignore[assignment]
