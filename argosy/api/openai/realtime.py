"""`/v1/audio/transcriptions/realtime`: live transcription over a WebSocket.

Connect with `?model=` (a transcription model; default the first), `sample_rate` (of the PCM
sent, 8000..48000, default 16000) and `language`. The key, where keys are set, goes in the
`Authorization` / `x-api-key` header or, from a browser, the subprotocol
`openai-insecure-api-key.KEY` (api/gate.py); a refused socket is closed before it opens.

The client sends audio as binary frames of 16-bit little-endian mono PCM, or as text frames
`{"type": "input_audio_buffer.append", "audio": "<base64 of the same>"}`, and
`{"type": "input_audio_buffer.commit"}` to end an utterance (`.clear` drops it). The server
sends
- `{"type": "transcript.partial", "item": N, "text", "audio_seconds"}` as audio arrives
  (the utterance so far, transcribed again after each further second of audio, while the
  recogniser is free);
- `{"type": "transcript.final", "item": N, "text", "audio_seconds"}` on commit, and by itself
  once an utterance reaches UTTERANCE_SECONDS (Whisper reads 30 s windows);
- `{"type": "error", "error": {"message", "code", "param"}}` for a message it cannot read
  (the session goes on), and before it closes the session past --max-audio-seconds (1009).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from argosy.audio.codecs import RECOGNISER_RATE
from argosy.audio.transcription import TranscribeOptions, TranscriptionService
from argosy.core.pipeline import RequestContext
from argosy.errors import ArgosyError, InvalidRequestError

router = APIRouter()

PARTIAL_EVERY_S = 1.0
UTTERANCE_SECONDS = 25.0
CLOSE_POLICY, CLOSE_TOO_BIG = 1008, 1009


def _error(exc: ArgosyError) -> dict[str, Any]:
    return {"type": "error", "error": {"message": exc.message, "code": exc.code, "param": exc.param}}


def _resampled(pcm: bytes, rate: int) -> np.ndarray:
    if len(pcm) % 2:
        raise InvalidRequestError("PCM audio is 16-bit: a frame must hold an even number of bytes.", "audio")
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if rate == RECOGNISER_RATE or samples.size == 0:
        return samples
    positions = np.arange(0, samples.size, rate / RECOGNISER_RATE)
    return np.interp(positions, np.arange(samples.size), samples).astype(np.float32)


class _Session:
    def __init__(
        self, ws: WebSocket, service: TranscriptionService, options: TranscribeOptions, rate: int
    ) -> None:
        self.ws = ws
        self.service = service
        self.options = options
        self.rate = rate
        self.chunks: list[np.ndarray] = []
        self.num_samples = 0
        self.since_partial = 0
        self.item = 0
        self.total_seconds = 0.0
        self.partial: asyncio.Task[None] | None = None

    @property
    def seconds(self) -> float:
        return self.num_samples / RECOGNISER_RATE

    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    async def add(self, pcm: bytes) -> None:
        samples = _resampled(pcm, self.rate)
        self.chunks.append(samples)
        self.num_samples += samples.size
        self.since_partial += samples.size
        self.total_seconds += samples.size / RECOGNISER_RATE
        if self.seconds >= UTTERANCE_SECONDS:
            await self.commit()
        elif self.since_partial >= PARTIAL_EVERY_S * RECOGNISER_RATE and (
            self.partial is None or self.partial.done()
        ):
            self.since_partial = 0
            self.partial = asyncio.create_task(self._send("transcript.partial", self.audio()))

    async def commit(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.partial
            self.partial = None
        audio = self.audio()
        self.clear()
        await self._send("transcript.final", audio)
        self.item += 1

    def clear(self) -> None:
        self.chunks, self.num_samples, self.since_partial = [], 0, 0

    async def _send(self, kind: str, audio: np.ndarray) -> None:
        text = ""
        if audio.size:
            transcript = await self.service.transcript(audio, self.options)
            text = transcript.text
        event = {
            "type": kind,
            "item": self.item,
            "text": text,
            "audio_seconds": round(audio.size / RECOGNISER_RATE, 3),
        }
        await self.ws.send_text(json.dumps(event))

    async def close(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.partial


@router.websocket("/v1/audio/transcriptions/realtime")
async def realtime_transcription(ws: WebSocket) -> None:
    app = ws.app
    params = ws.query_params
    try:
        rate = int(params.get("sample_rate", RECOGNISER_RATE))
        if not 8000 <= rate <= 48000:
            raise InvalidRequestError(f"sample_rate must be 8000..48000, got {rate}.", "sample_rate")
        entry = app.state.registry.resolve(params.get("model"), "transcription")
        ctx = RequestContext(request_id="-", route="WEBSOCKET /v1/audio/transcriptions/realtime")
        ctx.key_name = ws.scope.get("state", {}).get("key_name")
        app.state.gate.policy(ctx, entry.spec)
        lease = await app.state.registry.acquire(entry)
    except ValueError:
        await ws.close(code=CLOSE_POLICY, reason="sample_rate must be an integer")
        return
    except ArgosyError as exc:
        await ws.close(code=CLOSE_POLICY, reason=exc.message[:120])
        return
    max_seconds = app.state.server_config.max_audio_seconds
    protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    try:
        service: TranscriptionService = lease.service
        options = TranscribeOptions(language=params.get("language") or None)
        service.check(options)
    except ArgosyError as exc:
        lease.release()
        await ws.close(code=CLOSE_POLICY, reason=exc.message[:120])
        return
    await ws.accept(subprotocol="realtime" if "realtime" in protocols else None)
    session = _Session(ws, service, options, rate)
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                if message.get("bytes") is not None:
                    await session.add(message["bytes"])
                else:
                    await _command(session, message.get("text") or "")
            except InvalidRequestError as exc:
                await ws.send_text(json.dumps(_error(exc)))
            if session.total_seconds > max_seconds:
                too_long = InvalidRequestError(
                    f"This session sent over {max_seconds:.0f} s of audio (--max-audio-seconds).", "audio"
                )
                await ws.send_text(json.dumps(_error(too_long)))
                await ws.close(code=CLOSE_TOO_BIG, reason="audio limit reached")
                return
    except WebSocketDisconnect:
        return
    finally:
        await session.close()
        lease.release()


async def _command(session: _Session, text: str) -> None:
    try:
        event = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError("A text frame must be a JSON event.", "type") from None
    kind = event.get("type") if isinstance(event, dict) else None
    if kind == "input_audio_buffer.append":
        try:
            pcm = base64.b64decode(str(event.get("audio", "")), validate=True)
        except binascii.Error:
            raise InvalidRequestError("'audio' must be base64 of 16-bit PCM.", "audio") from None
        await session.add(pcm)
    elif kind == "input_audio_buffer.commit":
        await session.commit()
    elif kind == "input_audio_buffer.clear":
        session.clear()
    else:
        raise InvalidRequestError(
            f"Unknown event type {kind!r}: input_audio_buffer.append, .commit or .clear.", "type"
        )
