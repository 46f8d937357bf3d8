"""Argosy: a self-hosted LLM inference daemon — one core, every dialect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
