"""Suite-wide guards for CI, which kills a run that passes its time limit without a word.

ARGOSY_TEST_BUDGET_S (the Makefile sets it): once the suite has run that long, it stops before
the next test with a failure that names where it got to, and pytest still prints its summary
and the slowest tests (--durations), so a run that is too slow says why instead of being cut.
Each test also has its own limit (pytest-timeout, pyproject's `timeout`): a hang fails that
test with every thread's stack and the suite goes on.
"""

from __future__ import annotations

import os
import time

import pytest

_STARTED = time.monotonic()

# tests/fleet start Ray, which must run inside a loopback-only network namespace: `make
# fleet-test` (part of `make test`) runs them there and sets this; a plain pytest skips them
collect_ignore = [] if os.environ.get("ARGOSY_FLEET_NETNS") == "1" else ["fleet"]

# Without a GPU, the CUDA path's Triton kernels run on the CPU through Triton's interpreter
# (tests/unit/test_gpu_layers.py). It is chosen when triton is first imported, so here, before
# any test module can import it; on a machine with CUDA the kernels compile for the GPU.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    budget = float(os.environ.get("ARGOSY_TEST_BUDGET_S", "0") or 0)
    elapsed = time.monotonic() - _STARTED
    if budget > 0 and elapsed > budget:
        pytest.exit(
            f"the suite ran {elapsed:.0f} s, past ARGOSY_TEST_BUDGET_S={budget:.0f}; stopped before {item.nodeid}",
            returncode=1,
        )
