"""Giving freed heap memory back to the OS."""

from __future__ import annotations

import contextlib
import ctypes


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc keeps them after loading and
    compiling, which would otherwise stay in the server's RSS for its whole life)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
