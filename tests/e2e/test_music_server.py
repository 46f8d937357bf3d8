"""Music jobs through the real server: a tiny random MusicGen folder (tests/tiny_musicgen.py)
passed as `--model` is served as kind `music`; `POST /v1/audio/generate` (task `music`, the
default) runs as an audio job, its result a decodable file of the asked duration, the same seed
the same file; bad bodies are 400s in OpenAI's error shape; a result survives a crash.
"""

from __future__ import annotations

import io
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.server import ServerProcess
from tests.tiny_musicgen import SAMPLE_RATE, build_tiny_musicgen

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = build_tiny_musicgen(tmp_path_factory.mktemp("music") / "tiny-musicgen")
    process = ServerProcess(model=str(folder), quantization=None, compile=None, served_model_name="musicgen")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def submit(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/generate", json=body, timeout=30)


def finished(server: ServerProcess, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = httpx.get(f"{server.base_url}/v1/audio/jobs/{job_id}", timeout=30).json()
        if job["status"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def result(server: ServerProcess, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """The 202 and the finished job's result."""
    created = submit(server, body)
    assert created.status_code == 202, created.text
    job = finished(server, created.json()["id"])
    assert job["status"] == "completed" and job["task"] == "music", job
    return created, httpx.get(f"{server.base_url}/v1/audio/jobs/{job['id']}/result", timeout=30)


def wav_samples(data: bytes) -> tuple[int, int, int]:
    """(rate, channels, frames) of a WAV file."""
    with wave.open(io.BytesIO(data)) as reader:
        return reader.getframerate(), reader.getnchannels(), reader.getnframes()


def test_a_music_job_makes_a_wav_of_the_asked_duration(server: ServerProcess) -> None:
    body = {
        "prompt": "a calm piano piece",
        "duration": 1.5,
        "seed": 7,
        "response_format": "wav",
        "voice": "alloy",
    }
    created, file = result(server, body)
    job = created.json()
    assert job["object"] == "audio.job" and job["model"] == "musicgen" and job["task"] == "music"
    assert created.headers["location"] == f"/v1/audio/jobs/{job['id']}"
    assert created.headers["x-argosy-seed"] == "7" and created.headers["x-argosy-degraded"] == "voice"
    assert file.headers["content-type"] == "audio/wav"
    assert wav_samples(file.content) == (SAMPLE_RATE, 1, round(1.5 * SAMPLE_RATE))
    _, again = result(server, body | {"voice": None})
    assert again.content == file.content  # the same seed: the same samples
    _, other = result(server, body | {"seed": 8})
    assert other.content != file.content and len(other.content) == len(file.content)


def test_a_drawn_seed_is_sent_back_and_formats_decode(server: ServerProcess) -> None:
    av = pytest.importorskip("av")
    created, drawn = result(
        server, {"task": "music", "prompt": "loud drums", "duration": 0.5, "response_format": "wav"}
    )
    assert "x-argosy-degraded" not in created.headers
    seed = int(created.headers["x-argosy-seed"])
    _, replayed = result(
        server, {"prompt": "loud drums", "duration": 0.5, "seed": seed, "response_format": "wav"}
    )
    assert replayed.content == drawn.content
    for fmt, media_type in (("flac", "audio/flac"), ("mp3", "audio/mpeg")):
        _, file = result(
            server, {"prompt": "loud drums", "duration": 0.5, "seed": seed, "response_format": fmt}
        )
        assert file.headers["content-type"] == media_type
        with av.open(io.BytesIO(file.content)) as container:
            stream = container.streams.audio[0]
            num_samples = sum(frame.samples for frame in container.decode(stream))
            seconds = num_samples / stream.rate
        if fmt == "flac":
            assert num_samples == round(0.5 * SAMPLE_RATE), num_samples
        else:  # LAME's delay and padding at 8 kHz: up to two 576-sample frames and more
            assert 0.5 <= seconds < 0.7, seconds


def test_bad_requests_are_400s(server: ServerProcess) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "  "}, "prompt"),
        ({"duration": 2}, "prompt"),
        ({"prompt": "x" * 4001}, "prompt"),
        ({"prompt": "a song", "duration": 0}, "duration"),
        ({"prompt": "a song", "duration": -3}, "duration"),
        ({"prompt": "a song", "duration": 600}, "duration"),
        ({"prompt": "a song", "duration": "long"}, "duration"),
        ({"prompt": "a song", "seed": -1}, "seed"),
        ({"prompt": "a song", "response_format": "ogg"}, "response_format"),
        ({"prompt": "a song", "task": "karaoke"}, "task"),
        ({"task": "speech", "model": "musicgen", "voice": "joe", "input": "Hi."}, "model"),
    ]
    for body, param in cases:
        response = submit(server, body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, (body, response.text)
        assert error["type"] == "invalid_request_error" and error["message"]
    unknown = submit(server, {"prompt": "a song", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_model_and_the_fields_are_described(server: ServerProcess) -> None:
    caps = httpx.get(f"{server.base_url}/v1/models/musicgen", timeout=30).json()["capabilities"]
    assert caps["kind"] == "music" and caps["tasks"] == ["music"] and caps["modalities"] == ["audio", "text"]
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    body = document["paths"]["/v1/audio/generate"]["post"]["requestBody"]["content"]["application/json"]
    schema = document["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[-1]]
    assert {"task", "prompt", "duration", "seed", "response_format"} <= set(schema["properties"])
    assert schema["properties"]["task"]["default"] == "music"


def test_a_result_survives_a_crash(server: ServerProcess) -> None:
    body = {"prompt": "a slow guitar song", "duration": 1.0, "seed": 3, "response_format": "wav"}
    created, before = result(server, body)
    server.kill()
    server.start()  # same port, same data directory
    after = httpx.get(f"{server.base_url}/v1/audio/jobs/{created.json()['id']}/result", timeout=30)
    assert after.status_code == 200 and after.content == before.content
    _, rerun = result(server, body)  # a fresh process: the same seed still gives the same file
    assert rerun.content == before.content
