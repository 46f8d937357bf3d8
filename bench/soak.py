"""Soak test: minutes of mixed traffic at a steady concurrency against a real `argosy serve`.

    python bench/soak.py                                   # the 0.5B, default mode (compiled), 30 min
    python bench/soak.py --mode eager --minutes 1 --concurrency 4
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --minutes 60

`--concurrency` worker threads (each its own httpx client) loop until the deadline over a
seeded mix: plain chat (streamed and not), tools with tool_choice "required", response_format
json_schema, n=2, /v1/completions, a 2-3 turn /v1/responses chain (previous_response_id), a
stream the client closes after a few chunks, and a deliberately invalid request (expects 400).
Every HTTP call is one outcome, classified as: ok | deliberate_4xx (the expected 400s) | 503
(with Retry-After; the worker backs off) | unexpected_4xx | 5xx (an error status, a 503 without
Retry-After, or an error event inside a 200 stream) | transport | timeout | bad_response (a 200
whose body breaks its contract: json_schema output that does not validate when finish_reason is
"stop", a tool_calls finish without a well-formed call, a stream without [DONE] ...).

Each minute prints one line: requests, ok, errors by class, p50/p99 latency of that minute's
completed ok requests (a cancelled stream counts its time to the cancel), and the RSS of the
server's process tree (sum of VmRSS; with --url, of --pid or the process listening on the port).
At the end, one line per figure and the verdict against the targets: no error outside
ok/deliberate_4xx/503, RSS growth from the end of minute 1 (warm-up) to the last minute <= 5%,
p99 of the last minute <= 2x the median of the per-minute p99s, and the engine drained (no
request left running once the traffic stops: a cancelled stream that leaked would stay).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc_stats import process_tree, status_kib  # noqa: E402
from soak_traffic import CLASSES, EXPECTED_CLASSES, MIX, Failure, Outcome, Scenarios, turn_text  # noqa: E402
from workloads import percentile  # noqa: E402

from tests.e2e.server import ServerProcess, wait_compiled  # noqa: E402


class Soak:
    def __init__(self, url: str, model: str, args: argparse.Namespace) -> None:
        self.url = url
        self.model = model
        self.args = args
        self.deadline = 0.0
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def call(self, scenario: str, action: Callable[[], Any]) -> tuple[bool, Any]:
        """Times one call and records its class; (ok?, what the action returned)."""
        started = time.monotonic()
        try:
            value = action()
            cls, detail, retry_after_s = "ok", "", 0.0
        except Failure as failure:
            cls, detail, retry_after_s, value = failure.cls, failure.detail, failure.retry_after_s, None
        except httpx.TimeoutException as error:
            cls, detail, retry_after_s, value = "timeout", type(error).__name__, 0.0, None
        except httpx.HTTPError as error:
            cls, detail, retry_after_s, value = "transport", f"{type(error).__name__}: {error}", 0.0, None
        except (KeyError, TypeError, IndexError, AttributeError) as error:  # a body missing a field
            cls, detail, retry_after_s, value = "bad_response", f"{type(error).__name__}: {error}", 0.0, None
        self.record(Outcome(scenario, cls, time.monotonic() - started, time.monotonic(), detail))
        if cls == "503":
            self.stop.wait(min(max(retry_after_s, 0.1), 5.0))
        elif cls in ("transport", "timeout"):
            self.stop.wait(0.5)  # a dead server must not turn the loop into a spin
        return cls in ("ok", "deliberate_4xx"), value

    def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        scenarios = Scenarios(self.model, rng, self.args.request_timeout)
        names = [name for name, _ in MIX]
        weights = [weight for _, weight in MIX]
        timeout = httpx.Timeout(self.args.request_timeout, connect=10.0)
        with httpx.Client(base_url=self.url, timeout=timeout) as http:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                name = rng.choices(names, weights)[0]
                if name == "responses":
                    previous: str | None = None
                    for turn in range(rng.randint(2, 3)):
                        turn_call = partial(scenarios.response_turn, http, turn_text(rng, turn), previous)
                        ok, previous = self.call(name, turn_call)
                        if not ok:
                            break
                else:
                    self.call(name, partial(getattr(scenarios, name), http))

    def run(self, server: ServerProcess | None, pid: int | None) -> list[tuple[float, float | None]]:
        """Runs the traffic, prints a line a minute; returns (p99 s, RSS MiB) per minute."""
        started = time.monotonic()
        self.deadline = started + self.args.minutes * 60
        threads = [
            threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.args.concurrency)
        ]
        for thread in threads:
            thread.start()
        minutes: list[tuple[float, float | None]] = []
        for minute in range(1, self.args.minutes + 1):
            boundary = started + minute * 60
            while time.monotonic() < boundary and not self.stop.is_set():
                if server is not None and server.process is not None and server.process.poll() is not None:
                    print(f"soak server exited with {server.process.returncode}", flush=True)
                    self.stop.set()
                time.sleep(min(1.0, max(0.0, boundary - time.monotonic())))
            is_last = minute == self.args.minutes or self.stop.is_set()
            if is_last:
                self.stop.set()
                for thread in threads:
                    thread.join(timeout=self.args.request_timeout + 10)
            rss = tree_rss_mib(pid) if pid is not None else None
            minutes.append(self.print_minute(minute, started, rss, is_last))
            if is_last:
                break
        return minutes

    def print_minute(
        self, minute: int, started: float, rss: float | None, is_last: bool
    ) -> tuple[float, float | None]:
        with self.lock:
            done = [
                o
                for o in self.outcomes
                if int((o.finished_at - started) // 60) + 1 == minute
                or (is_last and int((o.finished_at - started) // 60) + 1 > minute)
            ]
        counts = Counter(o.cls for o in done)
        latencies = [o.latency_s for o in done if o.cls == "ok"]
        p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
        errors = " ".join(f"{cls} {counts[cls]}" for cls in CLASSES[1:])
        rss_text = f"{rss:.1f} MiB" if rss is not None else "n/a"
        print(
            f"soak minute {minute} requests {len(done)} ok {counts['ok']} {errors} "
            f"p50 {p50:.2f} s p99 {p99:.2f} s rss {rss_text}",
            flush=True,
        )
        return p99, rss


def tree_rss_mib(root_pid: int) -> float | None:
    if status_kib(root_pid, "VmRSS") is None:
        return None
    return sum(status_kib(pid, "VmRSS") or 0 for pid in process_tree(root_pid)) / 1024


def pid_listening_on(port: int) -> int | None:
    """The pid holding a listening TCP socket on `port` (a local --url server), from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None


def engine_drained(url: str, model: str, wait_s: float = 20.0) -> tuple[bool, str]:
    """Whether the engine holds no request once the traffic stopped (cancelled streams aborted)."""
    deadline = time.monotonic() + wait_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            stats = httpx.get(f"{url}/v1/argosy/engine", params={"model": model}, timeout=5).json()
        except (httpx.HTTPError, ValueError) as error:
            return False, f"engine stats unavailable: {error}"
        if (
            stats.get("num_running") == 0
            and stats.get("num_waiting") == 0
            and stats.get("num_in_flight") == 0
        ):
            break
        time.sleep(0.5)
    keys = ("num_running", "num_waiting", "num_in_flight", "num_free_blocks", "num_total_blocks")
    shown = " ".join(f"{key} {stats.get(key)}" for key in keys)
    is_drained = all(stats.get(key) == 0 for key in keys[:3])
    return is_drained, shown


def summarize(soak: Soak, minutes: list[tuple[float, float | None]], drained: tuple[bool, str]) -> bool:
    counts = Counter(o.cls for o in soak.outcomes)
    print(f"soak total requests {len(soak.outcomes)}", flush=True)
    for cls in CLASSES:
        print(f"soak total {cls} {counts[cls]}", flush=True)
    for scenario, _ in MIX:
        mine = [o for o in soak.outcomes if o.scenario == scenario]
        latencies = [o.latency_s for o in mine if o.cls == "ok"]
        print(
            f"soak scenario {scenario} requests {len(mine)} ok {len(latencies)} "
            f"p50 {percentile(latencies, 50):.2f} s p99 {percentile(latencies, 99):.2f} s",
            flush=True,
        )
    unexpected = Counter(
        (o.scenario, o.cls, o.detail[:200]) for o in soak.outcomes if o.cls not in EXPECTED_CLASSES
    )
    for (scenario, cls, detail), count in unexpected.most_common(10):
        print(f"soak unexpected {count}x {scenario} {cls}: {detail}", flush=True)
    checks = {"no_unexpected_errors": not unexpected}
    warm_rss, end_rss = minutes[0][1], minutes[-1][1]
    if warm_rss is not None and end_rss is not None:
        growth = (end_rss - warm_rss) / warm_rss * 100
        print(f"soak rss_warmup {warm_rss:.1f} MiB", flush=True)
        print(f"soak rss_end {end_rss:.1f} MiB", flush=True)
        print(f"soak rss_growth {growth:+.2f} %", flush=True)
        checks["rss_growth_le_5pct"] = growth <= 5.0
    else:
        print("soak rss n/a (no server pid: pass --pid)", flush=True)
    p99s = [p99 for p99, _ in minutes if p99 == p99]  # NaN: a minute without an ok request
    if p99s:
        median_p99 = statistics.median(p99s)
        print(f"soak p99_min {min(p99s):.2f} s", flush=True)
        print(f"soak p99_max {max(p99s):.2f} s", flush=True)
        print(f"soak p99_median {median_p99:.2f} s", flush=True)
        print(f"soak p99_last {minutes[-1][0]:.2f} s", flush=True)
        checks["p99_last_le_2x_median"] = minutes[-1][0] <= 2 * median_p99
    else:
        checks["p99_last_le_2x_median"] = False
    print(f"soak engine_after {drained[1]}", flush=True)
    checks["engine_drained"] = drained[0]
    for name, passed in checks.items():
        print(f"soak check {name} {'PASS' if passed else 'FAIL'}", flush=True)
    is_pass = all(checks.values())
    print(f"soak result {'PASS' if is_pass else 'FAIL'}", flush=True)
    return is_pass


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="soak a running server (default: start one)")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid (default: the port's listener)")
    parser.add_argument("--model-id", help="model id to request (default: the server's first)")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="the model the started server serves")
    parser.add_argument(
        "--mode",
        choices=("default", "eager"),
        default="default",
        help="default: int4 + compiled; eager: bf16",
    )
    parser.add_argument("--threads", type=int, default=2, help="the started server's torch threads")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    parser.add_argument("--server-flags", default="", help="extra flags for the started server")
    args = parser.parse_args()
    if args.minutes < 1 or args.concurrency < 1:
        parser.error("--minutes and --concurrency must be at least 1")
    return args


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args()
    server = None
    url, pid = args.url, args.pid
    if url is None:
        is_eager = args.mode == "eager"
        server = ServerProcess(
            model=args.model,
            threads=args.threads,
            quantization="none" if is_eager else None,
            compile="off" if is_eager else None,
            startup_timeout_s=args.startup_timeout,
            extra_flags=args.server_flags.split(),
        )
    try:
        if server is not None:
            started = time.monotonic()
            server.start()
            assert server.process is not None
            url, pid = server.base_url, server.process.pid
            print(f"soak server_start {time.monotonic() - started:.1f} s (log {server.log_path})", flush=True)
        elif pid is None:
            parsed = urlparse(url)
            if parsed.hostname in ("127.0.0.1", "localhost", "0.0.0.0"):
                pid = pid_listening_on(parsed.port or 80)
        model = args.model_id or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        if server is not None and args.mode == "default":
            # the background compile's memory is start-up, not growth: traffic starts once it ended
            waited = time.monotonic()
            compiled = wait_compiled(url, model)["compile"]
            print(f"soak compile {compiled} after {time.monotonic() - waited:.0f} s more", flush=True)
        print(
            f"soak config url {url} model {model} pid {pid} minutes {args.minutes} "
            f"concurrency {args.concurrency} seed {args.seed}",
            flush=True,
        )
        soak = Soak(url, model, args)
        minutes = soak.run(server, pid)
        drained = engine_drained(url, model)
        is_pass = summarize(soak, minutes, drained)
    except KeyboardInterrupt:
        is_pass = False
    finally:
        if server is not None:
            server.stop()
    return 0 if is_pass else 1


if __name__ == "__main__":
    raise SystemExit(main())
