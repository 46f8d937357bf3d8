"""OpenAI `POST /v1/audio/speech` over a speech model (argosy/audio/speech.py).

JSON body: `model`, `input` (1..--max-speech-chars characters, 4096 by default as OpenAI's),
`voice` (a name, or `{"id": name}`), `response_format` (`mp3` default, `opus`, `aac`, `flac`,
`wav`, `pcm`: raw 16-bit little-endian mono at 24 kHz), `speed` (0.25–4.0), `stream_format`
(`audio`, the default: the file's bytes sent as each sentence is synthesised; `sse`:
`speech.audio.delta` events with base64 audio, then `speech.audio.done`).

The first sentence is synthesised before the answer's status goes out, so a voice that fails
at once is an error status, not an empty 200. A streamed WAV declares an unknown length (as
streaming WAV writers do; decoders read to the end). x-argosy-sample-rate says the rate;
x-argosy-degraded names `instructions` (the voices take no style prompt), `voice` when an
OpenAI voice name was spoken by the model's default voice, and unknown fields.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from argosy.api.errors import openai_error_body
from argosy.api.framing import SSEResponse, sse_frames
from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import WireModel, degraded_headers, named_unknown
from argosy.audio.codecs import SPEECH_FORMATS, AudioEncoder
from argosy.audio.speech import MAX_SPEED, MIN_SPEED, SpeechService
from argosy.errors import InvalidRequestError

router = APIRouter()
RATE_HEADER = "x-argosy-sample-rate"


class SpeechRequest(WireModel):
    model: str | None = None
    input: str
    voice: str | dict[str, Any]
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream_format: Literal["audio", "sse"] = "audio"

    def check(self, max_chars: int) -> None:
        if not self.input.strip():
            raise InvalidRequestError("'input' must hold some text to speak.", param="input")
        if len(self.input) > max_chars:
            raise InvalidRequestError(
                f"'input' is {len(self.input)} characters; this server speaks at most {max_chars} per "
                "request (--max-speech-chars; longer text can run as an audio job, POST /v1/audio/generate).",
                param="input",
                code="string_above_max_length",
            )
        self.voice_name()

    def voice_name(self) -> str:
        voice: Any = self.voice
        if isinstance(voice, dict):
            voice = voice.get("id")
        if not isinstance(voice, str) or not voice:
            raise InvalidRequestError("'voice' must be a voice name or {\"id\": name}.", param="voice")
        return voice


class SpeechRoute(ModelRoute[SpeechRequest]):
    route = "POST /v1/audio/speech"
    kind = "speech"
    body_type = SpeechRequest

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars  # --max-speech-chars

    def check(self, body: SpeechRequest) -> None:
        body.check(self.max_chars)

    async def serve(self, body: SpeechRequest, service: SpeechService, call: RouteCall) -> Response:
        voice, replaced = service.resolve_voice(body.voice_name())
        degraded = (["instructions"] if body.instructions else []) + (["voice"] if replaced else [])
        degraded += named_unknown(body.model_extra or {})
        fmt = SPEECH_FORMATS[body.response_format]
        encoder = AudioEncoder(fmt, service.sample_rate, streaming=True)
        chunks = service.synthesize(body.input, voice, body.speed)
        first = await anext(chunks, None)  # a voice that fails at once: an error status
        headers = {RATE_HEADER: str(encoder.output_rate), **degraded_headers(degraded)}
        audio = _encoded(first, chunks, encoder)
        if body.stream_format == "sse":
            frames = sse_frames(_sse_events(audio), openai_error_body, done=False)
            return call.release_with(SSEResponse(frames, headers=headers))
        return call.release_with(SSEResponse(audio, headers=headers, media_type=fmt.media_type))


async def _encoded(first: Any, rest: AsyncIterator[Any], encoder: AudioEncoder) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            data = encoder.add(first)
            if data:
                yield data
        async for chunk in rest:
            data = encoder.add(chunk)
            if data:
                yield data
        tail = encoder.finish()
        if tail:
            yield tail
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def _sse_events(audio: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    total = 0
    try:
        async for data in audio:
            total += len(data)
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
    finally:
        await audio.aclose()  # type: ignore[attr-defined]
    yield {"type": "speech.audio.done", "usage": {"output_bytes": total}}


@router.post("/v1/audio/speech")
@takes(SpeechRequest, streams=True, answers="audio/mpeg")
async def create_speech(request: Request) -> Response:
    return await run_route(request, SpeechRoute(request.app.state.server_config.max_speech_chars))
