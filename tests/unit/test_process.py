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
