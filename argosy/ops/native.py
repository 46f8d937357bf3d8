"""Argosy's native (C++) CPU ops, built with torch's extension builder: by `make install`
(`python -m argosy.ops.native`), else on first use.

`load_native_ops()` compiles argosy/ops/csrc/*.cpp once per machine (~30 s; the build is
kept in the virtual environment, else under ~/.cache/argosy (`build_dir`), keyed by the sources
and flags, and shared by processes through a lock that a killed build does not leave behind) and
registers the ops under torch.ops.argosy_ext. It
returns False when there is no compiler or the build fails; callers then use the Python ops,
which compute the same thing. `set_native_ops_enabled(False)` (the `--native-ops off` flag, set
once at start-up) disables them.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from argosy.progress import StatusLine

log = logging.getLogger("argosy.runner")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode.cpp", "packed_linear.cpp", "qlinear.cpp")]
_state: dict[str, bool] = {}
_enabled = [True]


def set_native_ops_enabled(enabled: bool) -> None:
    """Process-wide switch, set once at start-up before any model loads (`--native-ops`)."""
    _enabled[0] = enabled
    if not enabled:
        _state["loaded"] = False


def build_dir() -> Path:
    """Where the native ops are built and found: inside the virtual environment Argosy runs from
    (`make install` builds them there, so a first `argosy serve` - by any user, with any HOME -
    loads them in a second instead of compiling for ~40 s), else under ~/.cache/argosy."""
    version = f"torch-{torch.__version__}"
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "share" / "argosy" / "torch_extensions" / version
    return Path.home() / ".cache" / "argosy" / "torch_extensions" / version


def compiler_hint() -> str:
    """What to say when native code could not be built: empty when a C++ compiler is on the
    PATH (the error says the rest), else how to install one."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) or shutil.which("g++") or shutil.which("clang++"):
        return ""
    return (
        " — no C++ compiler was found, so decoding stays eager (slower); install one "
        "(Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; macOS: xcode-select --install) "
        "and start again"
    )


def native_sources_digest(directory: Path = _CSRC) -> str:
    """A digest of every native source file (both libraries): what a compiled graph calling
    these ops was built against."""
    digest = hashlib.sha256()
    for source in sorted(directory.iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return "argosy-native-" + digest.hexdigest()[:16]


def _build(name: str, sources: list[Path], cflags: list[str], directory: Path) -> Exception | None:
    """Build (or reuse) and load one library of ops with torch's extension builder (-O3,
    OpenMP and `cflags`); the exception when it could not (no compiler, no ninja, an error)."""
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        # torch's builder waits while its `lock` file exists, and a builder that was killed
        # (a first start stopped mid-build) leaves it behind: every later start would wait
        # forever. So builders take an flock first (the kernel drops it when its holder dies),
        # and whoever holds it removes a `lock` no live builder can own.
        guard = open(directory / "argosy-build.flock", "a+")  # noqa: SIM115 - held across the build
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        with guard, StatusLine(f"building the native kernels for this CPU ({name}; first start only)"):
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=["-O3", "-fopenmp", *cflags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - whatever failed, the caller falls back
        return exc
    return None


def load_native_ops() -> bool:
    """Build (or reuse) and load the native ops; True when torch.ops.argosy_ext is usable."""
    if "loaded" in _state:
        return _state["loaded"]
    _state["loaded"] = False
    if not _enabled[0]:
        log.info("native ops disabled (--native-ops off)")
        return False
    started = time.perf_counter()
    # -ffast-math: vectorised expf (glibc's libmvec) in the softmax, 16 at a time
    error = _build("argosy_native", _SOURCES, ["-march=native", "-ffast-math"], build_dir())
    if error is not None:
        log.warning("native ops unavailable (%s); using the Python ops%s", error, compiler_hint())
        return False
    _register_fakes()
    _state["loaded"] = True
    log.info("native ops loaded in %.1fs", time.perf_counter() - started)
    return True


def load_invariant_ops() -> bool:
    """Build (or reuse) and load the invariant kernels (csrc/iq_linear.cpp, iq_packed.cpp,
    iq_attention.cpp,
    iq_geglu.cpp, iq_norm.cpp, iq_rope.cpp, iq_lora.cpp, iq_argmax.cpp) as their own library, torch.ops.argosy_iq: built
    without -ffast-math and with -ffp-contract=off, so the compiler cannot reorder or fuse their
    float arithmetic, and without -march=native
    (each path carries its own target attribute and is chosen at run time by CPU features).
    False when there is no compiler, the build fails, or native ops are switched off."""
    if "invariant" in _state:
        return _state["invariant"]
    _state["invariant"] = False
    if not _enabled[0]:
        return False
    started = time.perf_counter()
    sources = [
        Path(__file__).parent / "csrc" / name
        for name in (
            "iq_linear.cpp",
            "iq_packed.cpp",
            "iq_attention.cpp",
            "iq_geglu.cpp",
            "iq_norm.cpp",
            "iq_rope.cpp",
            "iq_lora.cpp",
            "iq_argmax.cpp",
        )
    ]
    error = _build(
        "argosy_invariant", sources, ["-ffp-contract=off", "-fno-fast-math"], build_dir() / "invariant"
    )
    if error is not None:
        log.warning("invariant kernels unavailable (%s)%s", error, compiler_hint())
        return False
    _register_invariant_fakes()
    forced = os.environ.get("ARGOSY_KERNEL_PATH")  # e.g. avx2 on an AVX-512 machine: measure it
    if forced:
        try:
            torch.ops.argosy_iq.set_path(forced)
        except RuntimeError as exc:
            log.warning("ARGOSY_KERNEL_PATH=%s not taken (%s)", forced, exc)
    _state["invariant"] = True
    log.info(
        "invariant kernels loaded in %.1fs: %s path (this CPU has %s)",
        time.perf_counter() - started,
        torch.ops.argosy_iq.path(),
        ", ".join(torch.ops.argosy_iq.paths()),
    )
    return True


def _register_invariant_fakes() -> None:
    def out_dtype(x: torch.Tensor, out_float32: bool) -> torch.dtype:
        return torch.float32 if out_float32 else x.dtype

    @torch.library.register_fake("argosy_iq::q4_linear")
    def _(x, codes, scales, mins, out_features, out_float32, fine=False):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], out_features, dtype=out_dtype(x, out_float32))

    @torch.library.register_fake("argosy_iq::attention")
    def _(q, k, v, k_cache, v_cache, slots, block_ids, mask, block_size):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("argosy_iq::rope")
    def _(x, cos, sin):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape)  # contiguous, whatever x's token stride

    @torch.library.register_fake("argosy_iq::rms_norm")
    def _(x, weight, eps, offset):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape)

    @torch.library.register_fake("argosy_iq::greedy")
    def _(logits):  # type: ignore[no-untyped-def]
        return logits.new_empty(logits.shape[0], 2, dtype=torch.long)

    @torch.library.register_fake("argosy_iq::geglu")
    def _(gate_up):  # type: ignore[no-untyped-def]
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("argosy_iq::swiglu")
    def _(gate_up):  # type: ignore[no-untyped-def]
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("argosy_iq::lora")
    def _(y, x, slot, scale, a, b):  # type: ignore[no-untyped-def]
        return y.new_empty(y.shape)

    @torch.library.register_fake("argosy_iq::lora_apply")
    def _(y, x, slot, scale, key):  # type: ignore[no-untyped-def]
        return y.new_empty(y.shape)

    @torch.library.register_fake("argosy_iq::lora_apply_")
    def _(y, x, slot, scale, key):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("argosy_iq::q8_linear")
    def _(x, codes, scales, mins, out_features, out_float32, code_lo, code_hi, fine=False):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], out_features, dtype=out_dtype(x, out_float32))

    @torch.library.register_fake("argosy_iq::kq_linear")
    def _(
        x,
        nib,
        high,
        scales,
        scale_d,
        mins,
        min_d,
        bits,
        bias,
        out_features,
        out_float32,
        fine=False,
        swiglu=False,
        add=None,
    ):  # type: ignore[no-untyped-def]
        width = out_features // 2 if swiglu else out_features
        return x.new_empty(x.shape[0], width, dtype=out_dtype(x, out_float32))


def invariant_ops_ready() -> bool:
    """Whether this process has loaded the invariant kernels (never builds them)."""
    return bool(_state.get("invariant"))


def native_ops_path(invariant: bool = False) -> str:
    """Which ops this process's steps run, as far as they were loaded (nothing is built here):
    "native+invariant-<path>" (the invariant quantized kernels on avx512-vnni, avx2 or scalar),
    "native+amx" (the native ops and the AMX quantized kernels), "native" or "python". Part
    of what identifies a model's numerics (the OpenAI routes' system_fingerprint)."""
    if invariant and _state.get("invariant"):  # the quantized layers' kernels and their path
        return f"native+invariant-{torch.ops.argosy_iq.path()}"
    if not _state.get("loaded"):
        return "python"
    return "native+amx" if bool(torch.ops.argosy_ext.qlinear_available()) else "native"


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the C++ op has no meta kernel)."""

    @torch.library.register_fake("argosy_ext::paged_decode")
    def _(q, k, v, k_cache, v_cache, slots, block_ids, mask, block_size):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("argosy_ext::q4_linear")
    def _(x, codes, scales, mins, out_features):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("argosy_ext::q8_linear")
    def _(x, codes, scales, out_features):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("argosy_ext::packed_linear")
    def _(x, key, out_features, bias):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], out_features)


def main() -> int:
    """`python -m argosy.ops.native`: build both libraries now (`make install` runs it); exit 1
    when one did not build (the server would then run the Python ops: slower, still correct)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load_native_ops() and load_invariant_ops()
    print(f"argosy native ops {'built' if built else 'NOT built'} in {build_dir()}")
    return 0 if built else 1


if __name__ == "__main__":
    raise SystemExit(main())
