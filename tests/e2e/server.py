"""ServerProcess: a real `python -m argosy serve` subprocess for e2e tests and benchmarks.

As in llama.cpp's server tests: options become flags, a free port is picked, the process is
started and waited on until GET /health answers 200, and killed on stop. Its output goes to
a log file the tests can read (the access log lines, say).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from argosy.models.build import resolve_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]

# a float model's `dtype auto`: bfloat16 where the CPU computes it (AVX-512 bf16, AMX), else
# float32 (an AVX2-only CPU) — whose KV cache takes twice the bytes per token
AUTO_FLOAT = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
# the KV pool that holds the default model's whole 8,192-token context in that dtype
FULL_CONTEXT_KV = "192M" if AUTO_FLOAT == "bfloat16" else "384M"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_compiled(base_url: str, model: str, timeout_s: float = 1100.0) -> dict[str, Any]:
    """The model's /v1/models capabilities once its background compile has ended (ready or
    failed); the server answers meanwhile, with eager steps. A cold inductor cache on a slow
    2-core machine (AVX2 only, measured here) takes ~10 minutes: the wait stays inside the
    per-test limit (pyproject's `timeout`, 1200 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        caps: dict[str, Any] = httpx.get(f"{base_url}/v1/models/{model}", timeout=10).json()["capabilities"]
        if caps["compile"] != "compiling" or time.monotonic() > deadline:
            return caps
        time.sleep(0.5)


@dataclass
class ServerProcess:
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free one at start
    served_model_name: str | None = None
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    max_num_seqs: int | None = None
    # one intra-op thread: the test client shares the 2 cores, and an OpenMP team whose second
    # thread is descheduled makes every op wait a time slice (steps measured 10x slower)
    threads: int | None = 1
    data_dir: Path | None = None  # None: a temporary directory, removed by stop()
    # the e2e suite pins greedy text measured on bf16 eager decoding, and a compile costs ~30 s
    # per server: tests of the default (int4, compiled) mode pass quantization/compile None
    quantization: str | None = "none"
    compile: str | None = "off"
    extra_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set (over this process's) for the server
    command: str = "serve"  # or "fleet" (tests/fleet: inside a loopback-only network namespace)
    # a cold machine builds the native ops and converts the GGUF first (minutes on a slow one)
    startup_timeout_s: float = 600.0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    health_seen: list[tuple[int, str]] = field(default_factory=list)  # (status, body) while starting
    _owned_data_dir: Path | None = None

    def flags(self) -> list[str]:
        options: dict[str, object | None] = {
            "--model": self.model,
            "--host": self.host,
            "--port": self.port,
            "--served-model-name": self.served_model_name,
            "--max-model-len": self.max_model_len,
            "--kv-cache-memory": self.kv_cache_memory,
            "--max-num-seqs": self.max_num_seqs,
            "--threads": self.threads,
            "--data-dir": self.data_dir,
            "--quantization": self.quantization,
            "--compile": self.compile,
        }
        flags = [item for flag, value in options.items() if value is not None for item in (flag, str(value))]
        return flags + self.extra_flags

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        if self.port == 0:
            self.port = free_port(self.host)
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="argosy-data-"))
            self._owned_data_dir = self.data_dir
        handle, name = tempfile.mkstemp(prefix="argosy-server-", suffix=".log")
        self.log_path = Path(name)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **self.env}
        with os.fdopen(handle, "wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "argosy", self.command, *self.flags()],
                cwd=REPO_ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"argosy serve exited with {self.process.returncode}:\n{self.log_text()[-4000:]}"
                )
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=2.0)
            except httpx.HTTPError:
                response = None
            if response is not None:
                if not self.health_seen or self.health_seen[-1] != (response.status_code, response.text):
                    self.health_seen.append((response.status_code, response.text))
                if response.status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"argosy serve not healthy after {self.startup_timeout_s}s:\n{self.log_text()[-4000:]}"
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown runs (what a crash leaves behind)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        try:
            self._terminate()
        finally:
            if self._owned_data_dir is not None:
                shutil.rmtree(self._owned_data_dir, ignore_errors=True)
                self.data_dir = self._owned_data_dir = None

    def _terminate(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


# The two models most multi-model tests need: SmolLM2 in bf16 eager (the e2e suite's pinned
# mode) and all-MiniLM-L6-v2 for embeddings (loaded on its first request).
SMOLLM2_AND_MINILM_TOML = """
[[model]]
id = "smollm2"
source = "smollm2"
quantization = "none"
compile = "off"
max_model_len = 1024

[[model]]
id = "minilm"
source = "minilm"
aliases = ["all-MiniLM-L6-v2"]
"""


@contextmanager
def models_server(directory: Path, models_toml: str, **options: Any) -> Iterator[ServerProcess]:
    """A server of the models `models_toml` configures (written under `directory`), stopped
    on exit; `options` are ServerProcess fields."""
    toml = directory / "models.toml"
    toml.write_text(models_toml)
    extra_flags = ["--models", str(toml), *options.pop("extra_flags", [])]
    server = ServerProcess(
        model=None,  # type: ignore[arg-type]
        quantization=None,
        compile=None,
        extra_flags=extra_flags,
        startup_timeout_s=600,
        **options,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
