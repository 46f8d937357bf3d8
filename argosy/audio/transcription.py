"""TranscriptionService: one loaded speech recogniser (faster-whisper over CTranslate2) as the
core sees it — a model of kind `transcription` in the registry, loaded on request like the
others, its work run on its own worker thread (argosy/audio/worker.py).

`transcribe` yields segments as the decoder finishes them (so a stream can send text before
the file is done). Temperature: unset or 0 runs Whisper's fallback schedule (0.0, 0.2, ...,
1.0: a segment whose text repeats itself or scores too low is decoded again hotter), as
OpenAI documents for `temperature: 0`; a value above 0 decodes at that temperature alone.
An English-only model (tiny.en) refuses another `language` and every translation, naming
what is missing; a multilingual Whisper folder does both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from argosy.audio.codecs import duration_of
from argosy.audio.sources import AudioSource, require_audio_library
from argosy.core.service import ModelInfo
from argosy.core.worker import WorkerModel
from argosy.errors import InvalidRequestError

FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True, slots=True)
class TranscribeOptions:
    task: str = "transcribe"  # transcribe | translate
    language: str | None = None  # ISO 639-1; None: detected (English-only models: "en")
    prompt: str | None = None
    temperature: float | None = None
    word_timestamps: bool = False


@dataclass(frozen=True, slots=True)
class Word:
    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] = field(default_factory=list)


@dataclass(slots=True)
class Transcript:
    language: str
    duration: float
    segments: list[Segment]

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments).strip()


class TranscriptionService(WorkerModel):
    kind = "transcription"

    def __init__(self, model_id: str, source: AudioSource, threads: int, created: int | None = None) -> None:
        require_audio_library("faster_whisper", "transcription")
        from faster_whisper import WhisperModel

        self._start_worker(model_id, created)
        self.source = source
        self.path = source.locate()
        self.model = WhisperModel(
            str(self.path), device="cpu", compute_type="int8", cpu_threads=threads, num_workers=1
        )
        self.is_multilingual = bool(self.model.model.is_multilingual)
        self.languages: tuple[str, ...] = tuple(self.model.supported_languages)

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("transcribe", "translate") if self.is_multilingual else ("transcribe",)

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return self._info(
            state,
            architecture=f"whisper ({self.source.backend})",
            dtype="int8",
            quantization="int8",
            memory_bytes=_file_bytes(self.path),
            tasks=self.tasks,
            languages=self.languages,
            description=self.source.description,
        )

    def check(self, options: TranscribeOptions) -> None:
        """A request this model cannot serve is a 400 naming the field, before any work."""
        if options.task == "translate" and not self.is_multilingual:
            raise InvalidRequestError(
                f"Model '{self.model_id}' ({self.source.description}) cannot translate: it knows English "
                "only. Translation needs a multilingual Whisper model (configure one as a "
                "transcription model).",
                param="model",
                code="translation_unsupported",
            )
        if options.language is not None and options.language not in self.languages:
            known = ", ".join(self.languages[:12]) + (", ..." if len(self.languages) > 12 else "")
            raise InvalidRequestError(
                f"Model '{self.model_id}' does not know language {options.language!r}; it knows: {known}.",
                param="language",
                code="unsupported_language",
            )

    async def transcribe(self, samples: np.ndarray, options: TranscribeOptions) -> AsyncIterator[Any]:
        """The language first (a str), then each Segment as it is decoded."""
        self.check(options)

        def run() -> Iterator[Any]:
            segments, info = self.model.transcribe(
                samples,
                task=options.task,
                language=options.language or ("en" if not self.is_multilingual else None),
                initial_prompt=options.prompt or None,
                temperature=(
                    FALLBACK_TEMPERATURES if not options.temperature else (float(options.temperature),)
                ),
                word_timestamps=options.word_timestamps,
                vad_filter=False,
            )
            yield str(info.language)
            for index, segment in enumerate(segments):
                yield _segment(index, segment)

        async for item in self.worker.iterate(run):
            yield item

    async def transcript(self, samples: np.ndarray, options: TranscribeOptions) -> Transcript:
        language, segments = "en", []
        async for item in self.transcribe(samples, options):
            if isinstance(item, str):
                language = item
            else:
                segments.append(item)
        return Transcript(language=language, duration=duration_of(samples), segments=segments)


def _segment(index: int, segment: Any) -> Segment:
    words = [
        Word(str(w.word), round(float(w.start), 3), round(float(w.end), 3), float(w.probability))
        for w in (segment.words or [])
    ]
    return Segment(
        id=index,
        seek=int(segment.seek),
        start=round(float(segment.start), 3),
        end=round(float(segment.end), 3),
        text=str(segment.text),
        tokens=[int(t) for t in segment.tokens],
        temperature=float(segment.temperature or 0.0),
        avg_logprob=float(segment.avg_logprob),
        compression_ratio=float(segment.compression_ratio),
        no_speech_prob=float(segment.no_speech_prob),
        words=words,
    )


def _file_bytes(path: Any) -> int:
    from pathlib import Path

    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
