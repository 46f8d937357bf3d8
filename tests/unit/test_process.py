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


REUSE = """
import resource, sys
import torch
from argosy.process import malloc_keeps_freed_memory
if sys.argv[1] == "configure":
    print("set", malloc_keeps_freed_memory())
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1000, 17920).fill_(1.0)  # a 1,000-token prefill's gate/up output: 71.7 MB
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[1:]))
"""


def faults_writing_71mb_again(mode: str, env: dict[str, str]) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", REUSE, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    return lines[0], int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_activation_is_reused_from_the_heap_unless_the_user_set_malloc() -> None:
    """A prefill-sized block freed and allocated again: glibc maps it afresh each time (17,500
    page faults for 71.7 MB); after start-up it is taken from the heap, its pages already there."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    assert faults_writing_71mb_again("plain", env)[1] > 17_000
    said, faults = faults_writing_71mb_again("configure", env)
    assert said == "set True" and faults < 1_000
    said, faults = faults_writing_71mb_again("configure", {**env, "MALLOC_MMAP_MAX_": "65536"})
    assert said == "set False" and faults > 17_000
