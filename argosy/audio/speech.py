"""SpeechService: one loaded voice model (Piper, or the espeak-ng program) as the core sees it
— a model of kind `speech` in the registry.

`synthesize(text, voice, speed)` yields mono int16 chunks, one per sentence as the voice
finishes it, so a streamed answer starts after the first sentence, not the last. `speed`
(0.25–4.0, OpenAI's range) stretches Piper's phoneme lengths and espeak's words per minute.

Voices: a Piper voice speaks as its dataset's name (`joe`), a multi-speaker one as each of its
speakers; espeak as its English voices. OpenAI's voice names (alloy, ash, ..., verse) are
accepted so clients written for OpenAI work unchanged: they get the model's default voice,
and the answer's x-argosy-degraded header names `voice` (nothing pretends to be `alloy`).
Any other name is a 400 listing the voices.
"""

from __future__ import annotations

import io
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from argosy.audio.sources import AudioSource, require_audio_library
from argosy.audio.transcription import _file_bytes
from argosy.core.service import ModelInfo
from argosy.core.worker import WorkerModel
from argosy.errors import InvalidRequestError, ModelLoadError

OPENAI_VOICES = frozenset(
    {
        "alloy",
        "ash",
        "ballad",
        "coral",
        "echo",
        "fable",
        "nova",
        "onyx",
        "sage",
        "shimmer",
        "verse",
        "marin",
        "cedar",
    }
)
MIN_SPEED, MAX_SPEED = 0.25, 4.0
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")


class SpeechService(WorkerModel):
    kind = "speech"

    def __init__(self, model_id: str, source: AudioSource, created: int | None = None) -> None:
        self._start_worker(model_id, created)
        self.source = source
        self.path = source.locate()
        self.backend: _Voice = (
            _EspeakVoice(self.path) if source.backend == "espeak" else _PiperVoice(self.path)
        )

    @property
    def sample_rate(self) -> int:
        return self.backend.sample_rate

    @property
    def voices(self) -> tuple[str, ...]:
        return self.backend.voices

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return self._info(
            state,
            architecture=self.source.backend,
            dtype="float32",
            quantization=None,
            memory_bytes=_file_bytes(self.path) if self.source.backend != "espeak" else None,
            tasks=("speech",),
            voices=self.voices,
            description=self.source.description,
        )

    def resolve_voice(self, voice: str) -> tuple[str, bool]:
        """(the voice to speak, whether the request's name was replaced by the default)."""
        if voice in self.voices:
            return voice, False
        if voice.lower() in OPENAI_VOICES:
            return self.voices[0], True
        raise InvalidRequestError(
            f"Model '{self.model_id}' has no voice {voice!r}; its voices: {', '.join(self.voices)} "
            f"(OpenAI's voice names are accepted too and speak as '{self.voices[0]}').",
            param="voice",
            code="unknown_voice",
        )

    async def synthesize(self, text: str, voice: str, speed: float = 1.0) -> AsyncIterator[np.ndarray]:
        async for chunk in self.worker.iterate(lambda: self.backend.sentences(text, voice, speed)):
            yield chunk


class _Voice:
    sample_rate: int
    voices: tuple[str, ...]

    def sentences(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]:
        raise NotImplementedError


class _PiperVoice(_Voice):
    def __init__(self, path: Any) -> None:
        require_audio_library("piper", "speech synthesis")
        from piper import PiperVoice

        try:
            self.voice = PiperVoice.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the Piper voice {path}: {exc}") from exc
        config = self.voice.config
        self.sample_rate = int(config.sample_rate)
        speakers = dict(getattr(config, "speaker_id_map", None) or {})
        self._speaker_ids: dict[str, int | None] = (
            {name: int(i) for name, i in speakers.items()} if speakers else {_dataset_name(path): None}
        )
        self.voices = tuple(self._speaker_ids)
        self._length_scale = float(getattr(config, "length_scale", 1.0) or 1.0)

    def sentences(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]:
        from piper import SynthesisConfig

        config = SynthesisConfig(speaker_id=self._speaker_ids[voice], length_scale=self._length_scale / speed)
        for chunk in self.voice.synthesize(text, syn_config=config):
            yield chunk.audio_int16_array


def _dataset_name(path: Any) -> str:
    import json
    from pathlib import Path

    try:
        config = json.loads(Path(f"{path}.json").read_text())
    except (OSError, ValueError):
        config = {}
    name = config.get("dataset") if isinstance(config, dict) else None
    return str(name) if name else Path(path).stem


class _EspeakVoice(_Voice):
    """The espeak-ng program: formant synthesis, light and fast, robotic."""

    sample_rate = 22_050
    WORDS_PER_MINUTE = 175

    def __init__(self, program: Any) -> None:
        self.program = str(program)
        listing = subprocess.run(
            [self.program, "--voices=en"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        names = [line.split()[1] for line in listing.splitlines()[1:] if len(line.split()) > 1]
        if not names:
            raise ModelLoadError(f"{self.program} lists no English voices")
        # en-us first: the default voice
        self.voices = tuple(sorted(set(names), key=lambda name: (name != "en-us", name)))

    def sentences(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]:
        import soundfile

        wpm = max(80, min(450, round(self.WORDS_PER_MINUTE * speed)))
        for sentence in (part.strip() for part in _SENTENCE_END.split(text)):
            if not sentence:
                continue
            result = subprocess.run(
                [self.program, "--stdout", "-v", voice, "-s", str(wpm), "--", sentence],
                capture_output=True,
                timeout=120,
                check=False,
            )
            if result.returncode != 0 or not result.stdout:
                raise RuntimeError(f"espeak-ng failed: {result.stderr.decode(errors='replace').strip()}")
            samples, _ = soundfile.read(io.BytesIO(result.stdout), dtype="int16")
            yield np.asarray(samples, dtype=np.int16).reshape(-1)
