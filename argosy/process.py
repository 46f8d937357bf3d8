"""Process-wide settings, made once at start-up (cli.serve, the offline LLM) and never by an
engine: two engines in one process would race on them."""

from __future__ import annotations

import os
import sys

import torch

from argosy.config import EngineConfig
from argosy.ops.native import set_native_ops_enabled


def configure_process(config: EngineConfig) -> None:
    """torch's CPU thread count and the native-ops switch, from the engine config; no Triton
    where there is no GPU."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    set_native_ops_enabled(config.native_ops == "on")
    hide_triton_without_a_gpu()


def hide_triton_without_a_gpu() -> None:
    """Without a CUDA device Triton has nothing to run on, but torch.compile imports it anyway
    (inductor asks whether it is there): 66 MiB of the server's resident memory, its shared
    library's pages. Where torch sees no GPU, `import triton` fails in this process, as if it
    were not installed; inductor then compiles for the CPU alone, as it does anyway. Not under
    Triton's interpreter (TRITON_INTERPRET=1: its kernels run on the CPU, as the tests do)."""
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if not torch.cuda.is_available():
        sys.modules["triton"] = None  # type: ignore[assignment]
