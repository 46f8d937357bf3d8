"""bf16 linear layers with oneDNN-packed weights, for CPU.

aten's bf16 matmul reorders the weight on every call; packing it once into oneDNN's
blocked layout makes the small-batch decode GEMVs 1.2-1.6x faster here (measured with
torch 2.13 on this machine's AVX-512 bf16 cores), for any batch size, with the same results.

The packed weight is an opaque MKLDNN tensor, which torch.compile cannot trace, so the call
goes through a custom op that finds the weight by key: compiled graphs keep a dynamic batch
dimension (inductor only packs weights itself for static shapes) and stay one graph. The op
is the C++ one (argosy/ops/csrc/packed_linear.cpp) when the native ops build: the Python
op's own layer cost ~30-100 us a call, 121 calls a decode step.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch import nn

from argosy.ops.native import load_native_ops

_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("argosy::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[key], bias, "none", [], "")


@packed_linear.register_fake
def _(x, key, out_features, bias):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], out_features)


def packing_supported(dtype: torch.dtype, device: str) -> bool:
    return (
        device == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and _bf16_packing_runs()
    )


@functools.cache
def _bf16_packing_runs() -> bool:
    """oneDNN's bf16 weight reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an
    AVX2-only CPU it raises (found on an AMD EPYC with AVX2 only), so a bf16 model there
    keeps plain linears instead of failing to load."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


# oneDNN picks the packed layout for this many rows; the layout then serves any row count.
# Measured on 30 layers of SmolLM2's four projection shapes (cold weights, one process per
# hint): a hint of 1 and one of 64 are even at 1-8 rows, and 64 is ~20% faster at 96-320
# rows (prefill): 28-33 vs 35-43 ms at 96 rows, 55-61 vs 72-87 ms at 320.
PACKING_ROWS_HINT = 64


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKING_ROWS_HINT)
        if load_native_ops():
            self.key = torch.ops.argosy_ext.register_packed(self.packed)
            self.op = torch.ops.argosy_ext.packed_linear
            weakref.finalize(self, torch.ops.argosy_ext.release_packed, self.key)
        else:
            self.key = next(_KEYS)
            _PACKED[self.key] = self.packed
            self.op = torch.ops.argosy.packed_linear
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.op(x.reshape(-1, self.in_features), self.key, self.out_features, self.bias)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed bf16"


def apply_packing(model: nn.Module) -> int:
    """Swap every remaining float nn.Linear (projections and the output head) for a packed
    one; quantized layers stay as they are. Returns the number swapped."""
    # names only: holding the modules would keep every float weight alive beside its packed
    # copy until the end (~270 MB more peak memory at load for SmolLM2)
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        parent_path, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, attr)
        setattr(parent, attr, PackedLinear(linear.weight, linear.bias))
        del linear
    return len(names)
