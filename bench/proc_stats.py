"""What a server process tree costs, read from /proc: peak RSS and how busy everyone else was.

`ProcessTreeSampler` walks the tree under a root pid every half second and keeps, per pid, the
largest VmHWM and CPU time seen. Peak RSS, start-up included, is the largest sum over one sample
of the root's own peak so far (VmHWM: its load's peak is never missed) and its descendants'
current VmRSS (a server that compiles at start counts the compilers running beside it). The sum
of every pid's own peak (`sum_of_peaks_mib`, the figure before 2026-12-06) counted compilers
that ran one after another as if they ran at once: 4 graphs' C++ builds of ~1 GB each read as
4 GB beside the server. Once `mark_serving()` is called (the server answers its health check),
each sample also sums the tree's current VmRSS, and the largest sum is the peak while serving
(a spike shorter than the half-second interval can be missed); between `begin_window()` and
`end_window()` (one workload) the same sum's peak is kept apart, so two systems can be compared
over the workloads both ran. `other_cpu_percent` is the share of the machine's CPU time, over the
sampler's life, used by processes outside the tree and outside this benchmark process: on a
shared machine that is the noise under every figure.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields restart after the last ')'
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root_pid: int) -> list[int]:
    children = _children_map()
    pids, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack.extend(children.get(pid, []))
    return pids


def status_kib(pid: int, field: str) -> int | None:
    """A kB field of /proc/<pid>/status (VmHWM, VmRSS); None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def process_cpu_ticks(pid: int) -> int | None:
    """utime + stime of one process, in clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from state


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks over all CPUs since boot; idle and iowait are not busy."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(values[:8])  # guest time is already inside user
    return total - values[3] - values[4], total


def own_cpu_ticks() -> int:
    times = os.times()
    return round((times.user + times.system) * CLOCK_TICKS_PER_S)


class ProcessTreeSampler:
    def __init__(self, root_pid: int, interval_s: float = 0.5) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.peak_kib_by_pid: dict[int, int] = {}
        self.serving = False
        self.serving_peak_kib = 0
        self.window_peak_kib: int | None = None  # inside a window: its peak so far
        self.tree_peak_kib = 0
        self.cpu_ticks_by_pid: dict[int, int] = {}
        self.machine_start = machine_cpu_ticks()
        self.own_start = own_cpu_ticks()
        self.machine_end = self.machine_start
        self.own_end = self.own_start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def mark_serving(self) -> None:
        with self._lock:
            self.serving = True
        self.sample()

    def sample(self) -> None:
        with self._lock:
            current_kib = 0
            tree_kib = 0
            for pid in process_tree(self.root_pid):
                rss = status_kib(pid, "VmRSS") or 0
                current_kib += rss
                kib = status_kib(pid, "VmHWM")
                if kib is not None:
                    self.peak_kib_by_pid[pid] = max(kib, self.peak_kib_by_pid.get(pid, 0))
                tree_kib += self.peak_kib_by_pid.get(pid, 0) if pid == self.root_pid else rss
                ticks = process_cpu_ticks(pid)
                if ticks is not None:
                    self.cpu_ticks_by_pid[pid] = max(ticks, self.cpu_ticks_by_pid.get(pid, 0))
            self.tree_peak_kib = max(self.tree_peak_kib, tree_kib)
            if self.serving:
                self.serving_peak_kib = max(self.serving_peak_kib, current_kib)
            if self.window_peak_kib is not None:
                self.window_peak_kib = max(self.window_peak_kib, current_kib)
            self.machine_end = machine_cpu_ticks()
            self.own_end = own_cpu_ticks()

    def begin_window(self) -> None:
        """Start keeping the tree's peak RSS apart (one workload), from this sample on."""
        with self._lock:
            self.window_peak_kib = 0
        self.sample()

    def end_window(self) -> float:
        """The tree's peak RSS (MiB) since `begin_window()`, this last sample included."""
        self.sample()
        with self._lock:
            peak, self.window_peak_kib = self.window_peak_kib or 0, None
        return peak / 1024

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        """One last sample, then no more (call before the tree is killed)."""
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)

    def peak_rss_mib(self) -> float:
        return self.tree_peak_kib / 1024

    def sum_of_peaks_mib(self) -> float:
        return sum(self.peak_kib_by_pid.values()) / 1024

    def serving_rss_mib(self) -> float | None:
        return self.serving_peak_kib / 1024 if self.serving else None

    def other_cpu_percent(self) -> float | None:
        busy = self.machine_end[0] - self.machine_start[0]
        total = self.machine_end[1] - self.machine_start[1]
        if total <= 0:
            return None
        ours = sum(self.cpu_ticks_by_pid.values()) + (self.own_end - self.own_start)
        return max(0.0, busy - ours) / total * 100
