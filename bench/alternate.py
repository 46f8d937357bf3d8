"""Single-stream decode, Argosy and a peer up at once, measured in alternation.

bench/compare.py runs one system after the other, so on a host whose speed drifts within minutes (a
VM whose memory bandwidth moved by a third between runs here) a single-stream ratio is partly the
hour's. This starts both servers, waits for Argosy's compiled graphs, warms both, then runs the same
seeded single-stream request against each in turn (the order flipped every round) and reports
each one's median tokens/s and the median of the per-round ratios.

    python bench/alternate.py --model qwen2.5-coder-1.5b --rounds 8 [--peer llama-server] [--workload code]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peer_builds  # noqa: E402
import peers  # noqa: E402
from workloads import Client, PromptTokenCounter, WorkloadRunner, Workloads  # noqa: E402

FIGURES = {"single": "decode_tok_s", "code": "code_tok_s", "grounded": "grounded_tok_s"}


async def alternate(
    servers: list[peers.RunningServer], model: peers.ModelFiles, args: argparse.Namespace
) -> dict[str, list[float]]:
    workloads = Workloads.quick()
    workloads.decode_tokens = args.tokens
    runner = WorkloadRunner(workloads, PromptTokenCounter(str(model.hf_dir)))
    clients = [
        Client(
            base_url=server.base_url,
            model=server.spec.request_model(model),
            overrides=lambda max_tokens, spec=server.spec: spec.request_overrides(model, max_tokens),
        )
        for server in servers
    ]
    figures: dict[str, list[float]] = {server.spec.name: [] for server in servers}
    for client in clients:
        await client.__aenter__()
    try:
        for client in clients:
            await runner.warm_up(client)
            await runner.run(args.workload, client, 0)
        for round_index in range(args.rounds):
            order = list(zip(servers, clients, strict=True))
            if round_index % 2:
                order.reverse()
            line = []
            for server, client in order:
                # the same prompt for both in a round, a new one each round
                result = await runner.run(args.workload, client, round_index + 1)
                value = result[FIGURES[args.workload]]
                figures[server.spec.name].append(value)
                line.append(f"{server.spec.name} {value:.1f}")
            print(f"round {round_index + 1}: " + ", ".join(line) + " tok/s", flush=True)
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--peer", default="llama-server", choices=sorted(peers.SERVERS))
    parser.add_argument("--workload", default="single", choices=sorted(FIGURES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens a request (single)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2))
    args = parser.parse_args()
    model = peers.load_model_files(args.model)
    servers: list[peers.RunningServer] = []
    try:
        for name in ("argosy", args.peer):
            spec = peers.SERVERS[name]
            if spec.build is not None:
                peer_builds.build(peer_builds.BUILDS[spec.build])  # a no-op once built
            ctx = peers.LaunchContext(
                model=model,
                threads=args.threads,
                port=peers.free_port(),
                slots=1,
                run_dir=peer_builds.PEERS_DIR / "run",
            )
            servers.append(peers.RunningServer(spec, ctx))
            print(f"[{name}] up: {' '.join(servers[-1].command)}", flush=True)
        figures = asyncio.run(alternate(servers, model, args))
    finally:
        for server in servers:
            server.stop()
    names = [server.spec.name for server in servers]
    ours, theirs = figures[names[0]], figures[names[1]]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(
        f"{args.workload}, {args.rounds} alternating rounds of {args.tokens} tokens: "
        f"{names[0]} {statistics.median(ours):.1f} tok/s, {names[1]} {statistics.median(theirs):.1f} tok/s (medians); "
        f"{names[0]} ÷ {names[1]} {statistics.median(ratios):.2f}× (median of the rounds' ratios; "
        f"range {min(ratios):.2f}-{max(ratios):.2f}×)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
