"""Start-up, side by side: seconds from starting a server to its /health 200 and to its first
answered chat request, on a machine whose caches are empty (cold) and again (warm).

    python bench/startup.py                       # smollm2: argosy and llama-server
    python bench/startup.py --model gemma3 --peers argosy,llama-server

Cold, for Argosy, is a fresh HOME (no converted GGUF) and a fresh inductor cache
(TORCHINDUCTOR_CACHE_DIR): what a new machine does after `make install`, whose native ops it
builds into the venv. Warm is a second
start with the same two. The Python packages and the OS page cache are shared (both servers' files
stay in memory between starts: llama-server's "cold" is warm there too, said in the header).
Argosy answers before its decode graphs are compiled (they build in the background); the table
also gives when they were ready. One server at a time, on 127.0.0.1, killed at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import peers  # noqa: E402
from host import machine_line  # noqa: E402


def start_once(
    spec: peers.ServerSpec, model: peers.ModelFiles, threads: int, env: dict[str, str], run_dir: Path
) -> dict[str, float | None]:
    """Seconds to /health 200, to the first chat answer and (Argosy) to its compiled graphs."""
    ctx = peers.LaunchContext(model=model, threads=threads, port=peers.free_port(), slots=1, run_dir=run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = f"http://{peers.HOST}:{ctx.port}"
    log = (run_dir / f"{spec.name}.log").open("wb")
    started = time.monotonic()
    process = subprocess.Popen(
        spec.command(ctx), cwd=peers.REPO_ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    figures: dict[str, float | None] = {"health": None, "first_answer": None, "compiled": None}
    try:
        with httpx.Client(base_url=base, timeout=600.0) as http:
            while figures["health"] is None:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{spec.name} exited: {(run_dir / f'{spec.name}.log').read_text()[-1500:]}"
                    )
                # every 50 ms, refused or not: a tight loop of /health while the model loads
                # takes CPU (and a Python server's GIL) from the start it measures
                try:
                    if http.get(spec.health_path, timeout=2.0).status_code == 200:
                        figures["health"] = time.monotonic() - started
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            body = {
                "model": spec.request_model(model),
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
            http.post("/v1/chat/completions", json=body).raise_for_status()
            figures["first_answer"] = time.monotonic() - started
            if spec.name.startswith("argosy"):  # until the background compile has ended
                while True:
                    caps = [m["capabilities"] for m in http.get("/v1/models").json()["data"]]
                    if all(c.get("compile") != "compiling" for c in caps):
                        if any(c.get("compile") == "ready" for c in caps):
                            figures["compiled"] = time.monotonic() - started
                        break
                    time.sleep(0.5)
    finally:
        process.kill()
        process.wait()
        log.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an Argosy registry name with a GGUF")
    parser.add_argument("--peers", default="argosy,llama-server")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = peers.load_model_files(args.model)  # converts in *this* HOME: the servers get a fresh one
    rows = []
    with tempfile.TemporaryDirectory(prefix="argosy-startup-") as scratch:
        root = Path(scratch)
        for name in args.peers.split(","):
            spec = peers.SERVERS[name]
            env = {
                "HOME": str(root / name / "home"),
                "TORCHINDUCTOR_CACHE_DIR": str(root / name / "inductor"),
            }
            (root / name / "home").mkdir(parents=True)
            for kind in ("cold", "warm"):
                figures = start_once(spec, model, args.threads, env, root / name / kind)
                rows.append((spec.label, kind, figures))
                print(spec.label, kind, figures, flush=True)

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(
        f"\n# Start-up, {args.model}, {time.strftime('%Y-%m-%d %H:%M')}; CPU: {machine_line()}, threads {args.threads}"
    )
    print("(cold: a fresh HOME and inductor cache; the OS page cache holds every file in both runs)\n")
    print("| Server | Caches | /health 200 (s) | First chat answer (s) | Compiled graphs ready (s) |")
    print("|---|---|---|---|---|")
    for label, kind, figures in rows:
        print(
            f"| {label} | {kind} | {cell(figures['health'])} | {cell(figures['first_answer'])} | {cell(figures['compiled'])} |"
        )


if __name__ == "__main__":
    main()
