"""Argosy: a self-hosted LLM inference daemon — one core, every dialect."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# torch's CPU allocator backs each allocation of 2 MiB or more with transparent huge pages when
# this is set (it reads it once, at its first allocation: so before torch is imported). A
# prefill's activations are tens of MB a layer, each a fresh mapping the first write faults in a
# page at a time: 4 KiB pages cost 65,000 to 511,000 page faults a 1,000-token prefill of
# Qwen2.5-Coder-1.5B (which of the two depended on glibc's state), 0.1-0.5 s of 4.1-4.6 s; huge
# pages 16,000. Set THP_MEM_ALLOC_ENABLE=0 to keep 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from argosy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from argosy.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the engine; import it only when asked for
    if name == "LLM":
        from argosy.llm import LLM

        return LLM
    raise AttributeError(name)
