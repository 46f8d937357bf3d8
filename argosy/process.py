"""Process-wide settings, made once at start-up (cli.serve, the offline LLM) and never by an
engine: two engines in one process would race on them."""

from __future__ import annotations

import torch

from argosy.config import EngineConfig
from argosy.ops.native import set_native_ops_enabled


def configure_process(config: EngineConfig) -> None:
    """torch's CPU thread count and the native-ops switch, from the engine config."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    set_native_ops_enabled(config.native_ops == "on")
