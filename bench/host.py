"""The machine and the build a bench ran on, for its report's header: the CPU with the vector
extensions that pick Argosy's kernel path, and Argosy's commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def machine_line() -> str:
    model_name = platform.processor() or "unknown CPU"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    extras = [
        flag
        for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
        if f" {flag}" in flags
    ]
    return f"nproc {os.cpu_count()}, {model_name} ({', '.join(extras) or 'no AVX2'})"


def versions_line() -> str:
    import transformers

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "argosy")
    except OSError:
        commit, dirty = "unknown", ""
    return (
        f"Argosy {commit}{' + uncommitted changes' if dirty else ''}; transformers {transformers.__version__}"
    )
