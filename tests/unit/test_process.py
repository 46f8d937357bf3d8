"""Process-wide start-up settings (argosy/process.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import sys
from argosy.config import EngineConfig
from argosy.process import configure_process
configure_process(EngineConfig())
try:
    import triton  # noqa: F401
except ImportError:
    print("hidden")
else:
    print("importable")
"""


def run(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: Triton stays")
def test_triton_is_hidden_without_a_gpu_unless_its_interpreter_runs() -> None:
    """torch.compile imports Triton when it is installed (66 MiB resident for nothing on a CPU):
    a server without a GPU hides it; under TRITON_INTERPRET=1 (Triton's kernels on the CPU) it
    stays importable."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    assert run(env) == "hidden"
    assert run({**env, "TRITON_INTERPRET": "1"}) == "importable"


ARENAS = """
import ctypes, sys, threading
from argosy.config import EngineConfig
from argosy.process import configure_process
if sys.argv[1] == "configure":
    configure_process(EngineConfig())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
together = threading.Barrier(4)
def allocate():  # a thread's first allocation: glibc gives it an arena of its own, up to the limit
    together.wait()
    libc.malloc(200_000)
    together.wait()  # all alive: no arena freed for another to take
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


def arenas(mode: str, env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", ARENAS, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_threads_share_one_malloc_arena_unless_the_user_set_a_limit() -> None:
    """Each arena keeps the memory freed in it (the server's RSS held the activations' freed
    memory once per thread that made them): after start-up every thread allocates from one."""
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    assert arenas("plain", env) > 1
    assert arenas("configure", env) == 1
    assert arenas("configure", {**env, "MALLOC_ARENA_MAX": "3"}) == 3
