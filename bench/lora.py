"""LoRA adapters per request: decode throughput with 8 clients over 4 adapters against 8
clients on the base model, on the same server (the default numerics, compiled decode), and the
base's throughput on a server without LoRA (what wrapping the layers costs requests that use
none). The adapters are made here by peft on the model's float32 weights (rank 8 on q/k/v/o
unless told otherwise, random non-zero B), as a fine-tune's would be shaped.

    .venv/bin/python bench/lora.py [--model qwen2.5-coder-0.5b] [--clients 8] [--adapters 4]
        [--rank 8] [--tokens 64] [--repetitions 3] [--threads 2] [--no-baseline]

Prints one line per phase (aggregate completion tok/s over the repetitions) and the ratios;
the adapters' runs alternate with the base's so drift hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.compare import machine_line  # noqa: E402
from bench.workloads import TOPICS, Client  # noqa: E402
from tests.e2e.server import ServerProcess, wait_compiled  # noqa: E402


def make_adapters(model: str, count: int, rank: int, folder: Path) -> list[Path]:
    """`count` PEFT folders for `model` (what peft's save_pretrained writes: the config and
    the lora_A / lora_B tensors by their peft names), A as peft initialises it (uniform,
    ±1/sqrt(in)), B random (a trained adapter's is not zero)."""
    from safetensors.torch import save_file

    from argosy.models.loader import resolve_model

    cfg = resolve_model(model).hf_config
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {
        "q_proj": heads * head_dim,
        "k_proj": cfg["num_key_value_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    ins = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim}
    paths = []
    for k in range(count):
        g = torch.Generator().manual_seed(100 + k)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for name, out in outs.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
                bound = ins[name] ** -0.5
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.rand(rank, ins[name], generator=g) * 2 - 1
                ) * bound
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
        path = folder / f"a{k}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(outs),
            "bias": "none",
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


async def aggregate(base_url: str, models: list[str], tokens: int, seed: int) -> float:
    """Completion tok/s of len(models) clients at once, client i asking models[i], two
    requests each (greedy, to max_tokens)."""
    clients = [Client(base_url, m, lambda n: {"ignore_eos": True}) for m in models]
    for client in clients:
        await client.__aenter__()
    try:

        async def one(i: int) -> int:
            total = 0
            for r in range(2):
                topic = TOPICS[(seed * 31 + i * 7 + r) % len(TOPICS)]
                messages = [{"role": "user", "content": f"Write a long, detailed essay about {topic}."}]
                result = await clients[i].chat(messages, tokens, seed + i)
                if not result.is_ok:
                    raise RuntimeError(f"{models[i]}: {result.error}")
                total += result.num_completion_tokens
            return total

        started = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(len(models))))
        return sum(done) / (time.perf_counter() - started)
    finally:
        for client in clients:
            await client.__aexit__()


def serve(model: str, threads: int, flags: list[str]) -> ServerProcess:
    server = ServerProcess(
        model=model,
        threads=threads,
        quantization=None,
        compile=None,
        kv_cache_memory="512M",
        extra_flags=flags,
    ).start()
    caps = wait_compiled(server.base_url, model)
    print(f"  {model} compile: {caps['compile']}", flush=True)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true", help="skip the server without LoRA")
    args = parser.parse_args()
    print(machine_line())
    folder = Path(tempfile.mkdtemp(prefix="argosy-lora-bench-"))
    adapters = make_adapters(args.model, args.adapters, args.rank, folder)
    names = [f"a{k}" for k in range(args.adapters)]
    flags = [
        item for name, path in zip(names, adapters, strict=True) for item in ("--lora", f"{name}={path}")
    ]
    base_models = [args.model] * args.clients
    adapter_models = [names[i % len(names)] for i in range(args.clients)]
    results: dict[str, list[float]] = {"base": [], "adapters": [], "no-lora base": []}
    server = serve(args.model, args.threads, flags)
    try:
        asyncio.run(aggregate(server.base_url, base_models[:2], 8, 0))  # warm-up
        for rep in range(args.repetitions):
            results["base"].append(asyncio.run(aggregate(server.base_url, base_models, args.tokens, rep)))
            results["adapters"].append(
                asyncio.run(aggregate(server.base_url, adapter_models, args.tokens, rep))
            )
            print(
                f"  rep {rep}: base {results['base'][-1]:.1f}, adapters {results['adapters'][-1]:.1f} tok/s"
            )
    finally:
        server.stop()
    if not args.no_baseline:
        plain = serve(args.model, args.threads, [])
        try:
            asyncio.run(aggregate(plain.base_url, base_models[:2], 8, 0))
            for rep in range(args.repetitions):
                results["no-lora base"].append(
                    asyncio.run(aggregate(plain.base_url, base_models, args.tokens, rep))
                )
        finally:
            plain.stop()
    median = {name: statistics.median(values) for name, values in results.items() if values}
    print(
        f"{args.model}, {args.clients} clients, {args.tokens} tokens each x2, rank {args.rank} q/k/v/o, "
        f"{args.adapters} adapters, threads {args.threads}"
    )
    for name, value in median.items():
        print(f"  {name:>13}: {value:7.1f} tok/s (median of {len(results[name])})")
    print(f"  adapters / base (same server): {median['adapters'] / median['base']:.2f}x")
    if "no-lora base" in median:
        print(f"  base with LoRA on / without: {median['base'] / median['no-lora base']:.2f}x")
        print(f"  adapters / base without LoRA: {median['adapters'] / median['no-lora base']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
