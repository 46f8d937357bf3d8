"""Process-wide settings, made once at start-up (cli.serve, the offline LLM) and never by an
engine: two engines in one process would race on them."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable
from typing import cast

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
    one_malloc_arena()
    malloc_keeps_freed_memory()


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


_M_ARENA_MAX = -8  # glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt(param, value) -> 1 when taken; None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return cast(Callable[[int, int], int], mallopt)


def one_malloc_arena() -> bool:
    """Every thread allocates from glibc's main heap (mallopt M_ARENA_MAX = 1), unless the user
    set MALLOC_ARENA_MAX. By default each thread that allocates while another holds the heap
    gets an arena of its own (up to 8 per core), and each keeps the memory freed in it: the
    engine's thread, the server's and torch's workers each held their own share of the
    activations' freed memory. Gemma 3 under bench/compare.py --model gemma3: peak RSS while
    serving 1,200 -> 1,101 MiB, the same speed. Called before the server's threads start
    (arenas already made stay). False where the C library is not glibc."""
    mallopt = _glibc_mallopt()
    if os.environ.get("MALLOC_ARENA_MAX") or mallopt is None:
        return False
    done = mallopt(_M_ARENA_MAX, 1) == 1
    if not done:
        logging.getLogger(__name__).debug("mallopt(M_ARENA_MAX, 1) refused")
    return done


def malloc_keeps_freed_memory() -> bool:
    """Large blocks from the heap, and freed memory kept there for the next step (mallopt
    M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 2 GiB), unless the user set MALLOC_MMAP_MAX_ or
    MALLOC_TRIM_THRESHOLD_. By default glibc maps each block above a threshold (at most 32 MiB)
    afresh and unmaps it when freed: a 1,000-token prefill's activations (the 1.5B's gate/up
    output is 71.7 MB a layer) then fault in a page at a time in every layer, or not, as the
    heap happened to stand: 60,000 to 750,000 page faults, 3.6 to 4.6 s, run to run in one
    engine. Kept in the heap: 60,000-81,000, and the server's prefill under bench/compare.py
    219-234 -> 269 tok/s, peak RSS while serving 2,094-2,131 -> 2,152 MiB. False where the C
    library is not glibc."""
    mallopt = _glibc_mallopt()
    if os.environ.get("MALLOC_MMAP_MAX_") or os.environ.get("MALLOC_TRIM_THRESHOLD_") or mallopt is None:
        return False
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
