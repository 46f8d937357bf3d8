"""Suite-wide guards for CI, which kills a run that passes its time limit without a word.

ARGOSY_TEST_BUDGET_S (the Makefile sets it): once the suite has run that long, it stops before
the next test with a failure that names where it got to, and pytest still prints its summary
and the slowest tests (--durations), so a run that is too slow says why instead of being cut.
Each test also has its own limit (pytest-timeout, pyproject's `timeout`): a hang fails that
test with every thread's stack and the suite goes on.

`make test` runs two test processes (pytest-xdist, `--dist loadscope`): a module's tests stay in
one process, so its module-scoped server starts once, and the modules below share a process
because they share something costly that should be built once, not twice at the same time.
"""

from __future__ import annotations

import os
import time

import pytest

# modules that run in one test process, one after another, as if they were one module
SHARED_SCOPES: dict[str, str] = {
    # SmolLM2's compiled decode graphs: the first compiles them into the cache, the rest hit it
    "tests/e2e/test_default_mode_server.py": "smollm2-compiled",
    "tests/e2e/test_models_server.py": "smollm2-compiled",
    "tests/unit/test_invariance.py": "smollm2-compiled",
    # the session-scoped qwen_server (tests/e2e/conftest.py): one real 0.5B server, not two
    "tests/e2e/test_chat_embeddings_server.py": "qwen-server",
    "tests/e2e/test_qwen_answers.py": "qwen-server",
    "tests/e2e/test_qwen_fim.py": "qwen-server",
    "tests/e2e/test_qwen_tools.py": "qwen-server",
}

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


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's loadscope scheduling with SHARED_SCOPES joined. (`--dist loadgroup` and its
    xdist_group mark would do this, but under pytest 9 the group never reaches the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedScopeScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_SCOPES.get(module) or super()._split_scope(nodeid)

    return SharedScopeScheduling(config, log)
