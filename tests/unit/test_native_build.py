"""The native ops' build (argosy/ops/native.py `_build`): a build that was killed leaves torch's
`lock` file behind, and torch's builder waits for it forever; the next build must not. And where
the build lives: in the virtual environment (`make install` builds it there), else under HOME."""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import pytest

import argosy.ops.native as native
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


def test_the_build_lives_in_the_venv_else_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a venv the build is the venv's: a first start with a fresh HOME (another user, a new
    container) finds what `make install` built; outside one (or a read-only one) it is HOME's."""
    venv, home = tmp_path / "venv", tmp_path / "home"
    venv.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(native.sys, "prefix", str(venv))
    monkeypatch.setattr(native.sys, "base_prefix", "/usr")
    assert native.build_dir().is_relative_to(venv / "share" / "argosy")
    venv.chmod(0o500)
    try:
        if not native.os.access(venv, native.os.W_OK):  # root writes anywhere: nothing to see there
            assert native.build_dir().is_relative_to(home / ".cache" / "argosy")
    finally:
        venv.chmod(0o700)
    monkeypatch.setattr(native.sys, "base_prefix", str(venv))  # no venv
    assert native.build_dir().is_relative_to(home / ".cache" / "argosy")
