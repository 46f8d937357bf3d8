"""The native ops' build (argosy/ops/native.py `_build`): a build that was killed leaves torch's
`lock` file behind, and torch's builder waits for it forever; the next build must not."""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import pytest

from argosy.ops.native import _build


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_build_stopped_midway_does_not_block_the_next(tmp_path: Path) -> None:
    source = tmp_path / "tiny.cpp"
    source.write_text(
        '#include <torch/library.h>\nTORCH_LIBRARY(argosy_build_test, m) { m.def("noop(Tensor x) -> Tensor"); }\n'
    )
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / "lock").touch()  # what a builder killed mid-way leaves
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        error = pool.submit(_build, "argosy_build_test", [source], [], directory).result(timeout=600)
    assert error is None
    assert not (directory / "lock").exists()
