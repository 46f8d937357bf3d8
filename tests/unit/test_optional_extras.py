"""The server without the `audio` and `images` extras: it builds and serves text, and an
audio or image model's load fails naming the extra (the libraries blocked in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = {"faster_whisper", "piper", "av", "soundfile", "diffusers", "ctranslate2", "onnxruntime"}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Blocker())

    from argosy.api.app import build_app
    from argosy.config import ModelSpec, ServerConfig
    from argosy.core.local import LocalModelLoader
    from argosy.core.registry import ModelRegistry
    from argosy.config import EngineConfig
    from argosy.errors import ModelLoadError

    specs = [ModelSpec("smollm2", "smollm2"), ModelSpec("whisper", "whisper-tiny.en", kind="transcription"),
             ModelSpec("voice", "piper-joe", kind="speech"), ModelSpec("sd", sys.argv[1], kind="image")]
    loader = LocalModelLoader(EngineConfig(model="smollm2"), ServerConfig())
    build_app(ModelRegistry(specs, loader), ServerConfig())
    for spec in specs[1:]:
        try:
            loader(spec)
        except ModelLoadError as exc:
            print(spec.id, exc.message)
    assert not any(name in sys.modules for name in ("faster_whisper", "piper", "av", "diffusers"))
    """
)


def test_no_audio_or_image_libraries(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert (
        "needs the Python package faster_whisper" in lines["whisper"] and "argosy[audio]" in lines["whisper"]
    )
    assert "needs the Python package piper" in lines["voice"] and "argosy[audio]" in lines["voice"]
    assert "needs the Python package diffusers" in lines["sd"] and "argosy[images]" in lines["sd"]
