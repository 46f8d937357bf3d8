"""Audio jobs: `POST /v1/audio/generate`, `GET /v1/audio/jobs/{id}`, `GET .../result`,
`DELETE /v1/audio/jobs/{id}` — long audio work run by the server's job queue
(argosy/core/jobs.py), kept in the session store so a restart loses no finished result.

`POST /v1/audio/generate` takes
- `task: "speech"` (JSON): `model`, `input` (up to MAX_JOB_SPEECH_CHARS: a whole document),
  `voice`, `response_format`, `speed` — as /v1/audio/speech, without its length cap;
- `task: "transcription"` (multipart, as /v1/audio/transcriptions, with a `task` field): a
  file up to --max-audio-body-bytes and MAX_JOB_AUDIO_SECONDS long, any response_format;
- `task: "music"` (JSON; the default): `model` (a MusicGen folder served as kind `music`,
  argosy/audio/music.py), `prompt` (1..MAX_MUSIC_PROMPT_CHARS), `duration` (seconds, above 0
  and at most MAX_MUSIC_SECONDS; DEFAULT_MUSIC_SECONDS if unset), `seed` (the same seed gives
  the same samples; without one a seed is drawn, kept with the job so a run again after a
  restart makes the same clip, and sent back in x-argosy-seed), `response_format` (any of
  /v1/audio/speech's). With no music model configured it is a 400 naming the missing kind.
and answers 202 with the job (`status: queued`, Location: the job's URL). The job reads back
as `queued`, `in_progress`, `completed` (its `result` says the media type and size),
`failed` (with `error`) or `cancelled`; `/result` is the finished file (409 before). The job
checks what it can at submit time (the model exists and is of the kind, the body's fields),
the rest (a voice, the file's audio) when it runs, as its error. The 202 of a JSON job names
in x-argosy-degraded the fields its task does not use (a music job's `voice`, `speed`,
`input`; a speech job's `prompt`, `duration`, `seed`), `instructions`, `stream_format: sse`
(a job does not stream) and unknown fields.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.forms import read_form
from argosy.api.openai.images import SEED_HEADER
from argosy.api.openai.speech import SpeechRequest
from argosy.api.openai.transcriptions import TranscriptionForm, rendered
from argosy.api.openapi import takes
from argosy.api.transport import read_model
from argosy.api.wire import degraded_headers, named_unknown
from argosy.audio.codecs import SPEECH_FORMATS, decode_upload, encode_all
from argosy.audio.music import (
    DEFAULT_MUSIC_SECONDS,
    MAX_MUSIC_PROMPT_CHARS,
    MAX_MUSIC_SECONDS,
    MusicRequest,
    MusicService,
    pcm16,
)
from argosy.audio.speech import SpeechService
from argosy.audio.transcription import TranscriptionService
from argosy.core.jobs import JobQueue, Runner
from argosy.core.registry import ModelRegistry
from argosy.errors import InvalidRequestError, ModelUnavailableError
from argosy.sessions.jobs import Job

router = APIRouter()

MAX_JOB_SPEECH_CHARS = 500_000  # about 80,000 words: a book's chapter or a long report
MAX_JOB_AUDIO_SECONDS = 4 * 3600.0


# the JSON fields each task leaves unused: named in x-argosy-degraded when sent
_UNUSED_BY_TASK = {
    "music": ("input", "voice", "speed", "instructions"),
    "speech": ("prompt", "duration", "seed", "instructions"),
}


class AudioJobRequest(SpeechRequest):
    """A JSON audio job: speech (`input`, `voice`, `speed`) or music (`prompt`, `duration`,
    `seed`); `response_format` is the result file's format for both."""

    task: Literal["speech", "transcription", "music"] = "music"
    input: str = ""
    voice: str | dict[str, Any] = ""
    prompt: str | None = Field(None, description="music: what to play (a text description)")
    duration: float | None = Field(
        None,
        gt=0,
        le=MAX_MUSIC_SECONDS,
        description=f"music: the clip's length in seconds ({DEFAULT_MUSIC_SECONDS:g} if unset)",
    )
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="music: the same seed gives the same samples"
    )

    def music_request(self, seed: int) -> MusicRequest:
        prompt = self.prompt or ""
        if not prompt.strip():
            raise InvalidRequestError(
                "'prompt' must describe the music (task 'music' is the default; a speech job sends "
                "task 'speech' and its 'input').",
                param="prompt",
            )
        if len(prompt) > MAX_MUSIC_PROMPT_CHARS:
            raise InvalidRequestError(
                f"'prompt' is {len(prompt)} characters; at most {MAX_MUSIC_PROMPT_CHARS}.",
                param="prompt",
                code="string_above_max_length",
            )
        duration = DEFAULT_MUSIC_SECONDS if self.duration is None else self.duration
        return MusicRequest(prompt, duration, seed)

    def degraded(self) -> list[str]:
        sent = {name for name in self.model_fields_set if getattr(self, name) not in (None, "")}
        unused = [name for name in _UNUSED_BY_TASK.get(self.task, ()) if name in sent]
        streamed = ["stream_format"] if self.stream_format == "sse" else []
        return unused + streamed + named_unknown(self.model_extra or {})


class TranscriptionJobForm(TranscriptionForm):
    task: Literal["transcription"] = "transcription"


def job_json(job: Job) -> dict[str, Any]:
    result = None
    if job.status == "completed":
        result = {
            "content_type": job.result_type,
            "bytes": job.result_bytes,
            "url": f"/v1/audio/jobs/{job.id}/result",
        }
    return {
        "id": job.id,
        "object": "audio.job",
        "task": job.task,
        "model": job.model,
        "status": job.status,
        "created_at": int(job.created_at),
        "started_at": None if job.started_at is None else int(job.started_at),
        "finished_at": None if job.finished_at is None else int(job.finished_at),
        "attempts": job.attempts,
        "error": None if job.error is None else {"message": job.error},
        "result": result,
    }


def _queue(request: Request) -> JobQueue:
    queue: JobQueue | None = request.app.state.audio_jobs
    if queue is None:
        raise ModelUnavailableError("Audio jobs need the session store, which this server runs without.")
    return queue


@router.post("/v1/audio/generate", status_code=202)
@takes(AudioJobRequest)
async def create_audio_job(request: Request) -> Response:
    queue = _queue(request)
    registry: ModelRegistry = request.app.state.registry
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form, upload = await read_form(request, TranscriptionJobForm)
        if upload is None:
            raise InvalidRequestError("Missing required parameter: 'file' (the audio file).", param="file")
        form.check("transcribe")
        if form.stream:
            raise InvalidRequestError(
                "An audio job does not stream: follow it at /v1/audio/jobs/{id}.", "stream"
            )
        entry = registry.resolve(form.model, "transcription")
        request_fields = form.model_dump(exclude_none=True, exclude={"stream"})
        job = await queue.submit("transcription", entry.spec.id, request_fields, upload.data)
        return _accepted(job, {})
    body = await read_model(request, AudioJobRequest)
    if body.task == "music":
        return await _submit_music(queue, registry, body)
    if body.task == "transcription":
        raise InvalidRequestError(
            "A transcription job sends its audio as multipart/form-data with a 'file' part.", param="file"
        )
    body.check(MAX_JOB_SPEECH_CHARS)
    entry = registry.resolve(body.model, "speech")
    request_fields = body.model_dump(exclude_none=True, exclude={"input"})
    job = await queue.submit("speech", entry.spec.id, request_fields, body.input.encode("utf-8"))
    return _accepted(job, degraded_headers(body.degraded()))


async def _submit_music(queue: JobQueue, registry: ModelRegistry, body: AudioJobRequest) -> Response:
    """A music job: checked whole here (the prompt, duration and format), its seed drawn now."""
    if not any(entry.spec.kind == "music" for entry in registry.entries):
        raise InvalidRequestError(
            "Music generation needs a model of kind 'music', and this server has none configured "
            "(serve a MusicGen folder with --model; it serves transcription and speech jobs: task "
            "'transcription' or 'speech').",
            param="task",
            code="model_kind_missing",
        )
    music = body.music_request(body.seed if body.seed is not None else MusicService.draw_seed())
    entry = registry.resolve(body.model, "music")
    request_fields = {"response_format": body.response_format, "duration": music.duration, "seed": music.seed}
    job = await queue.submit("music", entry.spec.id, request_fields, music.prompt.encode("utf-8"))
    return _accepted(job, {SEED_HEADER: str(music.seed), **degraded_headers(body.degraded())})


def _accepted(job: Job, headers: dict[str, str]) -> Response:
    headers = {"location": f"/v1/audio/jobs/{job.id}", **headers}
    return JSONResponse(job_json(job), status_code=202, headers=headers)


@router.get("/v1/audio/jobs/{job_id}")
async def retrieve_audio_job(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(job_json(await _queue(request).get(job_id)))


@router.get("/v1/audio/jobs/{job_id}/result")
async def audio_job_result(request: Request, job_id: str) -> Response:
    content, media_type = await _queue(request).result(job_id)
    return Response(content, media_type=media_type)


@router.delete("/v1/audio/jobs/{job_id}")
async def delete_audio_job(request: Request, job_id: str) -> JSONResponse:
    await _queue(request).delete(job_id)
    return JSONResponse({"id": job_id, "object": "audio.job.deleted", "deleted": True})


def job_runners(registry: ModelRegistry) -> dict[str, Runner]:
    """The runners of each job task, over the registry's models (leased while a job runs)."""

    async def speech(job: Job, data: bytes) -> tuple[bytes, str]:
        body = SpeechRequest.model_validate({**job.request, "input": data.decode("utf-8")})
        lease = await registry.acquire(registry.resolve(job.model, "speech"), queue_for_slot=True)
        try:
            service: SpeechService = lease.service
            voice, _ = service.resolve_voice(body.voice_name())
            chunks = [chunk async for chunk in service.synthesize(body.input, voice, body.speed)]
            fmt = SPEECH_FORMATS[body.response_format]
            return await asyncio.to_thread(encode_all, chunks, fmt, service.sample_rate), fmt.media_type
        finally:
            lease.release()

    async def transcription(job: Job, data: bytes) -> tuple[bytes, str]:
        form = TranscriptionForm.model_validate(job.request)
        samples = await asyncio.to_thread(
            decode_upload, data, param="file", max_seconds=MAX_JOB_AUDIO_SECONDS
        )
        lease = await registry.acquire(registry.resolve(job.model, "transcription"), queue_for_slot=True)
        try:
            service: TranscriptionService = lease.service
            transcript = await service.transcript(samples, form.options("transcribe"))
        finally:
            lease.release()
        return rendered(transcript, form, "transcribe")

    async def music(job: Job, data: bytes) -> tuple[bytes, str]:
        fields = job.request
        music = MusicRequest(data.decode("utf-8"), float(fields["duration"]), int(fields["seed"]))
        lease = await registry.acquire(registry.resolve(job.model, "music"), queue_for_slot=True)
        try:
            service: MusicService = lease.service
            samples = await service.generate(music)
        finally:
            lease.release()
        fmt = SPEECH_FORMATS[fields["response_format"]]
        encoded = await asyncio.to_thread(encode_all, [pcm16(samples)], fmt, service.sample_rate)
        return encoded, fmt.media_type

    return {"speech": speech, "transcription": transcription, "music": music}
