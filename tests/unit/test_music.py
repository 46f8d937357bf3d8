"""Music generation (argosy/audio/music.py) on a tiny random MusicGen built here: the seed makes
samples repeatable, the duration sets the sample count, and the samples are transformers' own
`generate` ones for the same seed. Also the folder's kind, the request's bounds, and the job
body's checks and degraded fields (argosy/api/openai/audio_jobs.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from argosy.audio.music import (
    MAX_MUSIC_SECONDS,
    MusicRequest,
    MusicService,
    is_musicgen_folder,
    pcm16,
)
from argosy.errors import ArgosyError, InvalidRequestError
from tests.tiny_musicgen import FRAME_RATE, NUM_CODEBOOKS, SAMPLE_RATE, build_tiny_musicgen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "a calm piano piece"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_musicgen(tmp_path_factory.mktemp("music") / "tiny-musicgen")


@pytest.fixture(scope="module")
def service(folder: Path) -> MusicService:
    music = MusicService("tiny-musicgen", str(folder))
    yield music
    music.shutdown()


def test_a_seed_repeats_its_samples_and_another_seed_differs(service: MusicService) -> None:
    first = service.samples(MusicRequest(PROMPT, 0.5, seed=7))
    again = service.samples(MusicRequest(PROMPT, 0.5, seed=7))
    other = service.samples(MusicRequest(PROMPT, 0.5, seed=8))
    assert first.dtype == np.float32 and first.std() > 0
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize("duration", [0.02, 0.5, 1.33])
def test_the_duration_sets_the_sample_count(service: MusicService, duration: float) -> None:
    samples = service.samples(MusicRequest(PROMPT, duration, seed=1))
    assert samples.shape == (round(duration * SAMPLE_RATE),)
    # frames to cover it, plus one step per codebook after the first (the delay pattern)
    assert service.max_new_tokens(duration) == int(np.ceil(duration * FRAME_RATE)) + NUM_CODEBOOKS - 1


def test_samples_are_transformers_generate_for_the_same_seed(service: MusicService, folder: Path) -> None:
    import torch
    from transformers import AutoProcessor, MusicgenForConditionalGeneration

    model = MusicgenForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text=[PROMPT], padding=True, return_tensors="pt")
    torch.manual_seed(1234)
    with torch.inference_mode():
        reference = model.generate(**inputs, max_new_tokens=service.max_new_tokens(0.8))
    ours = service.samples(MusicRequest(PROMPT, 0.8, seed=1234))
    assert reference.shape[-1] >= ours.size == round(0.8 * SAMPLE_RATE)
    assert np.array_equal(ours, reference[0, 0, : ours.size].numpy())


def test_generate_runs_on_the_worker_and_leaves_the_global_rng_alone(service: MusicService) -> None:
    import torch

    torch.manual_seed(99)
    before = torch.get_rng_state()
    samples = asyncio.run(service.generate(MusicRequest(PROMPT, 0.3, seed=3)))
    assert threading.current_thread() is threading.main_thread()
    assert np.array_equal(samples, service.samples(MusicRequest(PROMPT, 0.3, seed=3)))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_stopped_generation_ends_with_an_error(service: MusicService) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(ArgosyError, match="stopped"):
        service.samples(MusicRequest(PROMPT, 1.0, seed=3), stop)


def test_the_folder_is_a_music_model(folder: Path, tmp_path: Path) -> None:
    from argosy.commands.model_specs import model_kind

    assert is_musicgen_folder(str(folder)) and model_kind(str(folder)) == "music"
    assert not is_musicgen_folder(str(tmp_path)) and not is_musicgen_folder(str(folder / "config.json"))


def test_model_info(service: MusicService) -> None:
    info = service.model_info()
    assert info.kind == "music" and info.tasks == ("music",) and info.is_loaded
    assert info.memory_bytes and "8000 Hz mono" in (info.description or "")


@pytest.mark.parametrize(
    ("prompt", "duration", "param"),
    [
        (" ", 1.0, "prompt"),
        (PROMPT, 0.0, "duration"),
        (PROMPT, -1.0, "duration"),
        (PROMPT, MAX_MUSIC_SECONDS + 0.1, "duration"),
    ],
)
def test_a_request_out_of_bounds_is_refused(prompt: str, duration: float, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        MusicRequest(prompt, duration, seed=0)
    assert caught.value.param == param


def test_pcm16_clips_and_rounds() -> None:
    out = pcm16(np.array([0.0, 0.5, 1.0, 1.7, -2.0], dtype=np.float32))
    assert out.dtype == np.int16 and out.tolist() == [0, 16384, 32767, 32767, -32767]


# -- the job body -----------------------------------------------------------------------------
def test_the_job_body_checks_music_fields_and_names_what_it_ignores() -> None:
    import pydantic

    from argosy.api.errors import from_validation_error
    from argosy.api.openai.audio_jobs import AudioJobRequest

    body = AudioJobRequest.model_validate_json(
        '{"prompt": "a slow song", "voice": "joe", "speed": 1.5, "temperature": 0.9, "seed": 5}'
    )
    assert body.task == "music" and body.duration is None
    request = body.music_request(5)
    assert (request.prompt, request.duration, request.seed) == ("a slow song", 10.0, 5)
    assert body.degraded() == ["voice", "speed", "temperature"]
    speech = AudioJobRequest.model_validate_json(
        '{"task": "speech", "input": "Hi.", "voice": "joe", "duration": 3, "stream_format": "sse"}'
    )
    assert speech.degraded() == ["duration", "stream_format"]
    for raw, param in [
        ('{"prompt": "x", "duration": 0}', "duration"),
        ('{"prompt": "x", "duration": 31}', "duration"),
        ('{"prompt": "x", "duration": "long"}', "duration"),
        ('{"prompt": "x", "duration": NaN}', "duration"),
        ('{"prompt": "x", "seed": -1}', "seed"),
        ('{"prompt": "x", "response_format": "ogg"}', "response_format"),
    ]:
        with pytest.raises(pydantic.ValidationError) as caught:
            AudioJobRequest.model_validate_json(raw)
        assert from_validation_error(caught.value).param == param, raw
    for raw in ('{"duration": 2}', '{"prompt": "  "}', '{"prompt": "' + "x" * 5000 + '"}'):
        with pytest.raises(InvalidRequestError) as refused:
            AudioJobRequest.model_validate_json(raw).music_request(0)
        assert refused.value.param == "prompt"
