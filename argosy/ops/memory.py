"""Giving freed heap memory back to the OS."""

from __future__ import annotations

import contextlib
import ctypes
import functools

# A step of this many tokens (a long prompt's chunk) leaves its activations' freed pages in the
# heap; they go back to the OS after it (ms beside the step's seconds)
TRIM_AFTER_TOKENS = 256


@functools.cache
def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6")
    return None


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc keeps them after loading and
    compiling, which would otherwise stay in the server's RSS for its whole life)."""
    libc = _libc()
    with contextlib.suppress(AttributeError):  # not glibc: nothing to do
        if libc is not None:
            libc.malloc_trim(0)


def release_after_step(tokens: int) -> None:
    """After a step of `tokens` tokens: trim the heap if the step was a long prompt's chunk."""
    if tokens >= TRIM_AFTER_TOKENS:
        release_free_memory()
