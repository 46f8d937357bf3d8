"""Layers made of other layers: a fused projection whose parts a file holds in different forms
(PartsLinear), and one weight held two ways, chosen by a step's rows (BatchSwitchLinear)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from argosy.ops.quantized_linear import Int8Linear


class PartsLinear(nn.Module):
    """A fused projection whose parts a file holds in different forms (a Q4_K_M file's q and k
    in Q4_K, its v in Q6_K): a layer a part, each at its own bits, the outputs side by side.
    Each output is its part's alone, whatever the others: the invariance holds."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = int(cast(Int8Linear, parts[0]).in_features)
        self.out_features = sum(int(cast(Int8Linear, p).out_features) for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
        """forward(x).split(sizes, dim=-1) without the concatenation, where every part ends at
        a cut (a Q4_K_M file's q and k in one part, v in the other): each piece a view of its
        part's output. None where a part ends inside a piece."""
        cuts, at = set(), 0
        for size in sizes:
            at += size
            cuts.add(at)
        widths = [int(cast(Int8Linear, p).out_features) for p in self.parts]
        edges = {sum(widths[: i + 1]) for i in range(len(widths))}
        if not edges <= cuts or at != self.out_features:
            return None
        pieces: list[torch.Tensor] = []
        remaining = list(sizes)
        for part, width in zip(self.parts, widths, strict=True):
            inside: list[int] = []
            while sum(inside) < width:
                inside.append(remaining.pop(0))
            pieces.extend(part(x).split(inside, dim=-1))
        return pieces


class BatchSwitchLinear(nn.Module):
    """Int4 weights for steps of few rows, float weights for the rest.

    A decode step of one or a few sequences is bound by reading the weights, where 4-bit
    weights win; at more rows (batched decode, prefill) the float kernels are faster
    (shared/notes/cpu-decode-probe.md). Both hold the same GGUF weights: the float copy is
    their dequantization. Under torch.compile the branch becomes a guard on the batch size,
    so each side gets its own graph.
    """

    def __init__(self, small: nn.Module, large: nn.Module, max_small_rows: int) -> None:
        super().__init__()
        self.small, self.large, self.max_small_rows = small, large, max_small_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        out: torch.Tensor = self.small(x) if rows <= self.max_small_rows else self.large(x)
        return out
