"""Grammar-constrained decoding seam.

A `TokenGuide` is a per-request object that says which tokens may come next, as a packed
int32 bitmask (bit j of word i allows token 32*i + j — xgrammar's own layout), and is told
every token actually sampled. The sampler applies the mask before sampling. Backends
(xgrammar, llguidance) live behind this protocol; no backend types leak past this file.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenGuide(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask for the next token into `bitmask[row]`."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar rejects it."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and only an end token may follow."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
