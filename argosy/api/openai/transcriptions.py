"""OpenAI `POST /v1/audio/transcriptions` and `POST /v1/audio/translations` over a
transcription model (argosy/audio/transcription.py).

The body is multipart, as the openai client sends it: `file` (any format FFmpeg decodes: wav,
mp3, flac, ogg, webm, m4a, ...), `model`, `language`, `prompt`, `temperature` (0–1),
`response_format` (`json` default, `text`, `srt`, `vtt`, `verbose_json`),
`timestamp_granularities[]` (`segment` default, `word`; only with `verbose_json`, as OpenAI
requires), `stream` (SSE `transcript.text.delta` per segment as it is decoded, then
`transcript.text.done` with the whole text and usage; with `json` or `text` only). Usage is
by duration on a whole answer (`{"type": "duration", "seconds"}`, as whisper-1's) and by
tokens on a stream's done event (as the spec has it there): input tokens are Whisper's encoder
frames (50 per second of audio), output tokens the text tokens decoded.

Refused with a 400 naming the field: an empty, corrupt or over-long file (--max-audio-seconds),
a language the model does not know, word timestamps without verbose_json, streaming a subtitle
format, translation on an English-only model (translation needs a multilingual Whisper).
Accepted but not honoured, and named in x-argosy-degraded: `include[]` (token logprobs are
not exposed by the recogniser), `chunking_strategy` (the whole file is decoded with Whisper's
own 30 s windows), and any field this route does not know.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from argosy.api.errors import openai_error_body
from argosy.api.forms import FormModel, Upload, read_form
from argosy.api.framing import SSEResponse, sse_frames
from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import degraded_headers
from argosy.audio.codecs import decode_upload, duration_of
from argosy.audio.subtitles import srt, vtt
from argosy.audio.transcription import Segment, TranscribeOptions, Transcript, TranscriptionService
from argosy.errors import InvalidRequestError

router = APIRouter()

ENCODER_FRAMES_PER_SECOND = 50  # Whisper's encoder: 1500 frames per 30 s window
ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]


class TranscriptionForm(FormModel):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: ResponseFormat = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["word", "segment"]] | None = None
    stream: bool = False
    include: list[str] | None = None
    chunking_strategy: str | None = None

    def check(self, task: str) -> None:
        granularities = set(self.timestamp_granularities or ())
        if granularities and self.response_format != "verbose_json":
            raise InvalidRequestError(
                "timestamp_granularities needs response_format 'verbose_json'.",
                param="timestamp_granularities",
            )
        if self.stream and self.response_format not in ("json", "text"):
            raise InvalidRequestError(
                f"stream works with response_format 'json' or 'text', not '{self.response_format}'.",
                param="stream",
            )
        if task == "translate" and self.language is not None:
            raise InvalidRequestError(
                "Translations read the language from the audio and write English: 'language' is not a "
                "field of this route.",
                param="language",
            )

    def degraded(self) -> list[str]:
        fields = [name for name in ("include", "chunking_strategy") if getattr(self, name)]
        return fields + self.unknown_fields

    def options(self, task: str) -> TranscribeOptions:
        return TranscribeOptions(
            task=task,
            language=self.language.lower() if self.language else None,
            prompt=self.prompt,
            temperature=self.temperature,
            word_timestamps="word" in (self.timestamp_granularities or ()),
        )


class TranscriptionRoute(ModelRoute[TranscriptionForm]):
    route = "POST /v1/audio/transcriptions"
    kind = "transcription"
    body_type = TranscriptionForm
    task = "transcribe"

    def __init__(self) -> None:
        self.upload: Upload | None = None

    async def read(self, request: Request) -> TranscriptionForm:
        form, self.upload = await read_form(request, TranscriptionForm)
        return form

    def check(self, body: TranscriptionForm) -> None:
        if self.upload is None:
            raise InvalidRequestError("Missing required parameter: 'file' (the audio file).", param="file")
        body.check(self.task)

    async def serve(
        self, body: TranscriptionForm, service: TranscriptionService, call: RouteCall
    ) -> Response:
        assert self.upload is not None
        options = body.options(self.task)
        service.check(options)  # before decoding: a refusal costs nothing
        config = call.request.app.state.server_config
        samples = decode_upload(self.upload.data, param="file", max_seconds=config.max_audio_seconds)
        headers = degraded_headers(body.degraded())
        if body.stream:
            frames = sse_frames(_stream_events(service, samples, options), openai_error_body, done=False)
            return call.release_with(SSEResponse(frames, headers=headers))
        transcript = await service.transcript(samples, options)
        content, media_type = rendered(transcript, body, self.task)
        return Response(content, media_type=media_type, headers=headers)


class TranslationRoute(TranscriptionRoute):
    route = "POST /v1/audio/translations"
    task = "translate"


def _usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def _segment_json(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "seek": segment.seek,
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,
        "tokens": segment.tokens,
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }


def language_name(code: str) -> str:
    """Whisper's English name of a language code (OpenAI's verbose_json says "english")."""
    try:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return code
    return str(LANGUAGES.get(code, code))


def rendered(transcript: Transcript, body: TranscriptionForm, task: str) -> tuple[bytes, str]:
    """The transcript in the body's response_format: (bytes, media type)."""
    fmt = body.response_format
    if fmt == "text":
        return (transcript.text + "\n").encode(), "text/plain; charset=utf-8"
    if fmt == "srt":
        return srt(transcript.segments).encode(), "text/plain; charset=utf-8"
    if fmt == "vtt":
        return vtt(transcript.segments).encode(), "text/vtt; charset=utf-8"
    usage = _usage(transcript.duration)
    if fmt == "json":
        return _json_bytes({"text": transcript.text, "usage": usage}), "application/json"
    payload: dict[str, Any] = {
        "task": "translate" if task == "translate" else "transcribe",
        "language": "english" if task == "translate" else language_name(transcript.language),
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    granularities = set(body.timestamp_granularities or ("segment",))
    if "segment" in granularities:
        payload["segments"] = [_segment_json(s) for s in transcript.segments]
    if "word" in granularities:
        payload["words"] = [
            {"word": w.word.strip(), "start": w.start, "end": w.end}
            for s in transcript.segments
            for w in s.words
        ]
    payload["usage"] = usage
    return _json_bytes(payload), "application/json"


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def _stream_events(
    service: TranscriptionService, samples: Any, options: TranscribeOptions
) -> AsyncIterator[dict[str, Any]]:
    parts: list[str] = []
    output_tokens = 0
    async for item in service.transcribe(samples, options):
        if isinstance(item, Segment):
            output_tokens += len(item.tokens)
        if isinstance(item, Segment) and item.text:
            delta = item.text if parts else item.text.lstrip()
            parts.append(delta)
            yield {"type": "transcript.text.delta", "delta": delta}
    text = "".join(parts).strip()
    audio_tokens = math.ceil(duration_of(samples) * ENCODER_FRAMES_PER_SECOND)
    usage = {
        "type": "tokens",
        "input_tokens": audio_tokens,
        "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": 0},
        "output_tokens": output_tokens,
        "total_tokens": audio_tokens + output_tokens,
    }
    yield {"type": "transcript.text.done", "text": text, "usage": usage}


@router.post("/v1/audio/transcriptions")
@takes(TranscriptionForm, upload="file", streams=True)
async def create_transcription(request: Request) -> Response:
    return await run_route(request, TranscriptionRoute())


@router.post("/v1/audio/translations")
@takes(TranscriptionForm, upload="file")
async def create_translation(request: Request) -> Response:
    return await run_route(request, TranslationRoute())
