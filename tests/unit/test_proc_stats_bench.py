"""bench/proc_stats.py: the start-up peak counts processes that ran at once, not one after another."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "proc_stats.py"

# a child that holds ~MiB of touched memory for a while, then exits
HOLD = "import sys, time; b = bytearray({mib} * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep({s})"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_proc_stats", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sequential_children_are_not_summed() -> None:
    # a parent that runs two 200 MiB children one after the other (a compiler run per graph)
    child = HOLD.format(mib=200, s=1.5)
    script = (
        "import subprocess, sys\n"
        f"for _ in range(2): subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    sampler = _module().ProcessTreeSampler(process.pid, interval_s=0.1)
    process.wait(timeout=60)
    time.sleep(0.2)
    sampler.stop()
    at_once, summed = sampler.peak_rss_mib(), sampler.sum_of_peaks_mib()
    assert 200 <= at_once < 380, at_once  # one child (~210) beside the small parent
    assert summed >= 400, summed  # the old figure: both children as if at once
