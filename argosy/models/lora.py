"""LoRA adapters on a decoder's projections, chosen per row of a batch, never merged.

Each projection that an adapter may touch (q/k/v, o, gate/up, down: our fused modules) is
wrapped in a `LoraLinear`: the base layer's output, then every row's own adapter's low-rank
product added (S-LoRA / Punica's gathered products): `y[t] + scale[t] * B_k (A_k x[t])` with
k the row's slot. Requests for different adapters and for the base share one batch; a row's
bits depend on its own adapter alone (the native kernel's fixed order, csrc/iq_lora.cpp), and a
base row keeps the base layer's bits exactly (nothing is added to it). The products run in
float32 on float32 copies of the adapter's weights, above the base's int8/int4 codes.

Which row takes which slot is two buffers every LoraLinear shares (`LoraRows`: a slot and a
scale per row, -1 for the base), filled by the runner before each step. They are buffers of
fixed size, so the compiled decode graph reads them as inputs, and the adapters' weights stay
out of it altogether: the op (`argosy::lora`, opaque to inductor) finds its layer's adapters
by a key. Loading or dropping an adapter changes no graph and compiles nothing.

A fused module's adapters stack: the A of each part it holds (q, k, v) one above the other, and
a B of the whole output's rows whose columns for another part's rank are zero; a zero product
adds nothing, so each output sums exactly its own part's terms, in order. The adapter's scale
(alpha / r) is folded into B, which is held transposed ([rank, out]: the kernel runs across
the outputs, one rank at a time).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from argosy.models.llama import DecoderForCausalLM
from argosy.models.quantize import FUSED_PARTS
from argosy.ops.native import invariant_ops_ready

BASE_SLOT = -1  # a row without an adapter

_keys = itertools.count(1)
_TARGETS: weakref.WeakValueDictionary[int, LoraTarget] = weakref.WeakValueDictionary()
_EMPTY = torch.empty(0)


class LoraTarget:
    """One projection's adapters: per slot, A [R, in] and B transposed [R, out] in float32, or
    empty tensors where the slot's adapter does not touch it. With the native kernels, a copy
    of the table lives in C++ too (argosy_iq::lora_set), where the compiled graph's op reads it."""

    def __init__(self, parts: list[tuple[str, int, int]], in_features: int, out_features: int) -> None:
        self.key = next(_keys)
        self.parts = parts  # (HF module name, first output row, end) of each part it holds
        self.in_features, self.out_features = in_features, out_features
        self.a: list[torch.Tensor] = []
        self.bt: list[torch.Tensor] = []
        self.native = invariant_ops_ready()
        _TARGETS[self.key] = self
        if self.native:  # the C++ table's entry goes with this object
            weakref.finalize(self, torch.ops.argosy_iq.lora_clear, self.key, -1)

    def set(self, slot: int, a: torch.Tensor, bt: torch.Tensor) -> None:
        while len(self.a) <= slot:
            self.a.append(_EMPTY)
            self.bt.append(_EMPTY)
        self.a[slot], self.bt[slot] = a.contiguous(), bt.contiguous()
        if self.native:
            torch.ops.argosy_iq.lora_set(self.key, slot, self.a[slot], self.bt[slot])

    def clear(self, slot: int) -> None:
        if slot < len(self.a):
            self.a[slot] = self.bt[slot] = _EMPTY
            if self.native:
                torch.ops.argosy_iq.lora_clear(self.key, slot)

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """Without the native kernels (or in another dtype, or on an accelerator): the same
        products, per adapter, with torch's matmuls."""
        rows = y.shape[0]
        out = y.float().clone()
        slot, scale = slot[:rows], scale[:rows]
        for k, (a, bt) in enumerate(zip(self.a, self.bt, strict=True)):
            picked = (slot == k).nonzero().squeeze(1)
            if a.numel() == 0 or picked.numel() == 0:
                continue
            delta = (x[picked].float() @ a.to(x.device).T) @ bt.to(x.device)
            out[picked] += scale[picked].unsqueeze(1) * delta
        return out.to(y.dtype)


@torch.library.custom_op("argosy::lora", mutates_args=())
def lora_op(
    y: torch.Tensor, x: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor, key: int
) -> torch.Tensor:
    """y plus each row's adapter's product for the projection `key` names (LoraTarget.apply)."""
    return _TARGETS[key].apply(y, x, slot, scale)


@lora_op.register_fake
def _(y: torch.Tensor, x: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor, key: int) -> torch.Tensor:
    return y.new_empty(y.shape)


class LoraRows:
    """Which slot and scale each row of the next step takes (BASE_SLOT: none): two fixed-size
    tensors every LoraLinear of a model holds as buffers."""

    def __init__(self, max_rows: int) -> None:
        self.slot = torch.full((max_rows,), BASE_SLOT, dtype=torch.long)
        self.scale = torch.zeros(max_rows, dtype=torch.float32)

    @property
    def max_rows(self) -> int:
        return int(self.slot.shape[0])

    def set(self, slots: list[int], scales: list[float]) -> None:
        if len(slots) > self.max_rows:
            raise RuntimeError(f"a step of {len(slots)} rows is above the LoRA rows' {self.max_rows}")
        self.slot[: len(slots)] = torch.tensor(slots, dtype=torch.long)
        self.scale[: len(scales)] = torch.tensor(scales, dtype=torch.float32)


class LoraLinear(nn.Module):
    """A projection with per-row adapters: the base layer, then argosy::lora."""

    def __init__(self, base: nn.Module, target: LoraTarget, rows: LoraRows) -> None:
        super().__init__()
        self.base = base
        self.target = target  # kept alive here: the op finds it by key
        self.key = target.key
        self.register_buffer("slot", rows.slot, persistent=False)
        self.register_buffer("scale", rows.scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x)
        # token rows, as the decoders call their projections (else flattened)
        y, rows = base.reshape(-1, base.shape[-1]), x.reshape(-1, x.shape[-1])
        if self.target.native and y.dtype == rows.dtype == torch.float32 and y.device.type == "cpu":
            # the C++ op over the C++ table (no Python in a compiled graph's step), adding into
            # the projection's own output (nothing else reads it; no copy for a base-only step)
            if y.is_contiguous():
                torch.ops.argosy_iq.lora_apply_(y, rows, self.slot, self.scale, self.key)
                return base
            out: torch.Tensor = torch.ops.argosy_iq.lora_apply(y, rows, self.slot, self.scale, self.key)
        else:
            out = torch.ops.argosy.lora(y, rows, self.slot, self.scale, self.key)
        return out.view(base.shape)


class LoraModel:
    """A model's projections wrapped for adapters (`install`), and the slots' weights."""

    def __init__(self, model: DecoderForCausalLM, max_rows: int) -> None:
        self.rows = LoraRows(max_rows)
        self.num_layers = len(model.layers)
        # (layer, HF module name) -> (its LoraTarget, first output row, end)
        self.parts: dict[tuple[int, str], tuple[LoraTarget, int, int]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # HF module name -> (out, in)
        self.targets: list[LoraTarget] = []
        for index, layer in enumerate(model.layers):
            for fused, names in FUSED_PARTS.items():
                parent_name, attr = fused.split(".")
                parent = getattr(layer, parent_name, None)
                base = getattr(parent, attr, None)
                if base is None:
                    continue
                in_features, out_features = _features(base)
                sizes = _part_sizes(model, fused, out_features)
                parts, start = [], 0
                for name, size in zip(names, sizes, strict=True):
                    short = name.split(".")[1]
                    parts.append((short, start, start + size))
                    self.shapes[short] = (size, in_features)
                    start += size
                target = LoraTarget(parts, in_features, out_features)
                for short, lo, hi in parts:
                    self.parts[(index, short)] = (target, lo, hi)
                self.targets.append(target)
                setattr(parent, attr, LoraLinear(base, target, self.rows))

    def put(
        self, slot: int, modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    ) -> None:
        """An adapter's weights into `slot`: (layer, module) -> (A [r, in], B [out, r], scale)."""
        by_target: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
        for (layer, name), (a, b, scale) in modules.items():
            target, lo, hi = self.parts[(layer, name)]
            by_target.setdefault(target.key, []).append((lo, hi, a, b, scale))
        for target in self.targets:
            found = by_target.get(target.key)
            if not found:
                target.clear(slot)
                continue
            rank = sum(a.shape[0] for _, _, a, _, _ in found)
            stacked_bt = torch.zeros(rank, target.out_features, dtype=torch.float32)
            at = 0
            for lo, hi, a, b, scale in sorted(found, key=lambda part: part[0]):
                stacked_bt[at : at + a.shape[0], lo:hi] = (b.float() * scale).T
                at += a.shape[0]
            stacked_a = torch.cat([a.float() for _, _, a, _, _ in sorted(found, key=lambda part: part[0])])
            target.set(slot, stacked_a, stacked_bt)

    def clear(self, slot: int) -> None:
        for target in self.targets:
            target.clear(slot)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a projection, whatever form the build gave it."""
    for owner in (module, getattr(module, "small", None), getattr(module, "large", None)):
        if owner is None:
            continue
        in_features = getattr(owner, "in_features", None)
        out_features = getattr(owner, "out_features", None)
        if in_features is not None and out_features is not None:
            return int(in_features), int(out_features)
        weight = getattr(owner, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[1]), int(weight.shape[0])
    raise ValueError(f"cannot tell the features of {type(module).__name__}")


def _part_sizes(model: DecoderForCausalLM, fused: str, out_features: int) -> list[int]:
    cfg = model.config
    if fused == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    if fused == "mlp.gate_up_proj":
        return [out_features // 2, out_features // 2]
    return [out_features]
