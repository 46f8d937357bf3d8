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


def test_a_window_keeps_the_peak_of_its_own_span() -> None:
    # a process that stays small for a second, then holds ~200 MiB
    script = "import time; time.sleep(1.2); " + HOLD.format(mib=200, s=2.0).removeprefix("import sys, time; ")
    process = subprocess.Popen([sys.executable, "-c", script])
    sampler = _module().ProcessTreeSampler(process.pid, interval_s=0.1)
    try:
        sampler.begin_window()
        time.sleep(0.6)
        small = sampler.end_window()
        time.sleep(1.2)  # now it holds the 200 MiB
        sampler.begin_window()
        time.sleep(0.3)
        large = sampler.end_window()
    finally:
        process.kill()
        sampler.stop()
    assert small < 100, small
    assert large >= 200, large


def _compare():  # type: ignore[no-untyped-def]
    path = BENCH.parent / "compare.py"
    spec = importlib.util.spec_from_file_location("bench_compare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_serving_rss_is_compared_over_the_workloads_both_ran() -> None:
    compare = _compare()
    workloads = compare.Workloads.quick()
    argosy = compare.SystemResult("argosy", figures={"serving_rss_mib": [2000.0]})
    argosy.serving_rss_by_workload = {"single": 1500.0, "concurrency_8": 1800.0, "concurrency_32": 2000.0}
    # llama-server cut off before its 32-slot server: 8 slots only
    llama = compare.SystemResult("llama-server", figures={"serving_rss_mib": [2321.0]})
    llama.serving_rss_by_workload = {"single": 2200.0, "concurrency_8": 2321.0}
    table = compare.render_table({"argosy": argosy, "llama-server": llama}, workloads, "header", ["footer"])
    row = next(line for line in table.splitlines() if "while serving" in line)
    assert row.split("|")[2:5] == [" 2,000 ", " 2,321 ", " 0.78× ¹ "], row  # 1,800 / 2,321
    assert (
        "¹ Peak RSS while serving over the workloads both ran (single, concurrency_8): Argosy 1,800 MiB"
        in table
    )
    # the same workloads on both: the columns' peaks, no note
    llama.serving_rss_by_workload["concurrency_32"] = 3668.0
    llama.figures["serving_rss_mib"] = [3668.0]
    table = compare.render_table({"argosy": argosy, "llama-server": llama}, workloads, "header", ["footer"])
    row = next(line for line in table.splitlines() if "while serving" in line)
    assert row.split("|")[4] == " 0.55× ", row
    assert "¹" not in table
