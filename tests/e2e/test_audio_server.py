"""Audio through the official openai client: transcription (faster-whisper tiny.en), speech
(the Piper voice joe, and espeak-ng where installed), and every refusal a 4xx naming what is
missing.

One server serves the audio models only (whisper-tiny.en loads at start-up, piper-joe on its
first request), with small caps so the limits can be shown: --max-audio-body-bytes 3M and
--max-audio-seconds 25. Speech is checked with a decoder (soundfile, PyAV), recognition by the
word error rate against the sentences spoken.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import wave
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.server import models_server
from tests.openai_schema import validate

pytest.importorskip("faster_whisper")
pytest.importorskip("piper")
sf = pytest.importorskip("soundfile")
av = pytest.importorskip("av")

pytestmark = pytest.mark.e2e

HAS_ESPEAK = shutil.which("espeak-ng") is not None
SENTENCES = [
    "The weather will be sunny with a light breeze this afternoon.",
    "Please put the vegetables in the oven for twenty minutes.",
    "The next train to the city leaves from platform four.",
    "She opened the window and listened to the birds singing.",
    "Our library is open every day except Sunday.",
]
MODELS = """
[[model]]
id = "whisper-tiny.en"
source = "whisper-tiny.en"

[[model]]
id = "tts"
source = "piper-joe"
aliases = ["tts-1"]
""" + ('\n[[model]]\nid = "espeak"\nsource = "espeak"\n' if HAS_ESPEAK else "")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    directory = tmp_path_factory.mktemp("audio")
    flags = ["--max-audio-body-bytes", "3M", "--max-audio-seconds", "25"]
    with models_server(directory, MODELS, extra_flags=flags, threads=2) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def spoken(client: openai.OpenAI) -> list[bytes]:
    """Each sentence spoken by the server's Piper voice, as WAV."""
    return [
        client.audio.speech.create(model="tts-1", voice="joe", input=text, response_format="wav").content
        for text in SENTENCES
    ]


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def word_errors(reference: str, hypothesis: str) -> int:
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def wer(references: list[str], hypotheses: list[str]) -> float:
    errors = sum(word_errors(r, h) for r, h in zip(references, hypotheses, strict=True))
    return errors / sum(len(words(r)) for r in references)


def duration(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.rate


def test_speech_to_transcription_round_trip(client: openai.OpenAI, spoken: list[bytes]) -> None:
    texts = [
        client.audio.transcriptions.create(model="whisper-tiny.en", file=(f"s{i}.wav", wav)).text
        for i, wav in enumerate(spoken)
    ]
    assert wer(SENTENCES, texts) <= 0.20, texts


@pytest.mark.skipif(not HAS_ESPEAK, reason="espeak-ng is not installed")
def test_espeak_voice_is_understood(client: openai.OpenAI) -> None:
    wav = client.audio.speech.create(model="espeak", voice="en-us", input=SENTENCES[2], response_format="wav")
    text = client.audio.transcriptions.create(model="whisper-tiny.en", file=("e.wav", wav.content)).text
    assert wer([SENTENCES[2]], [text]) <= 0.35, text


def test_json_and_verbose_json_follow_the_spec(client: openai.OpenAI, spoken: list[bytes]) -> None:
    raw = client.audio.transcriptions.with_raw_response.create(
        model="whisper-tiny.en", file=("a.wav", spoken[0])
    )
    body = json.loads(raw.content)
    validate("CreateTranscriptionResponseJson", body)
    assert body["usage"]["type"] == "duration" and body["usage"]["seconds"] >= 1
    raw = client.audio.transcriptions.with_raw_response.create(
        model="whisper-tiny.en",
        file=("a.wav", spoken[0]),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    verbose = json.loads(raw.content)
    validate("CreateTranscriptionResponseVerboseJson", verbose)
    assert verbose["language"] == "english" and verbose["task"] == "transcribe"
    assert verbose["segments"] and verbose["words"]
    starts = [w["start"] for w in verbose["words"]]
    assert starts == sorted(starts) and verbose["words"][-1]["end"] <= verbose["duration"] + 0.5
    assert " ".join(w["word"] for w in verbose["words"]).split() == verbose["text"].split()
    only_words = client.audio.transcriptions.create(
        model="whisper-tiny.en",
        file=("a.wav", spoken[0]),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert only_words.words and not getattr(only_words, "segments", None)


def test_subtitle_formats(client: openai.OpenAI, spoken: list[bytes]) -> None:
    # two sentences in one file: numbered cues, in order
    both = np.concatenate([sf.read(io.BytesIO(w), dtype="int16")[0] for w in spoken[:2]])
    buffer = io.BytesIO()
    sf.write(buffer, both, 22050, format="WAV", subtype="PCM_16")
    audio = buffer.getvalue()
    srt = client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("a.wav", audio), response_format="srt"
    )
    cue = re.compile(r"(\d+)\n(\d\d:\d\d:\d\d,\d\d\d) --> (\d\d:\d\d:\d\d,\d\d\d)\n(.+?)\n(?:\n|$)", re.S)
    cues = cue.findall(srt)
    assert cues and [int(c[0]) for c in cues] == list(range(1, len(cues) + 1)), srt
    assert all(c[1] < c[2] for c in cues)
    vtt = client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("a.wav", audio), response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n")
    times = re.findall(r"^(\d\d:\d\d:\d\d\.\d\d\d) --> (\d\d:\d\d:\d\d\.\d\d\d)$", vtt, re.M)
    assert len(times) == len(cues)
    text = client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("a.wav", audio), response_format="text"
    )
    assert wer([" ".join(SENTENCES[:2])], [text]) <= 0.25


def test_streamed_deltas_join_to_the_final_text(client: openai.OpenAI, spoken: list[bytes]) -> None:
    events = list(
        client.audio.transcriptions.create(model="whisper-tiny.en", file=("a.wav", spoken[1]), stream=True)
    )
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert deltas and len(done) == 1 and events[-1] is done[0]
    assert "".join(d.delta for d in deltas).strip() == done[0].text
    for event in events:
        validate(
            "TranscriptTextDeltaEvent" if event.type.endswith("delta") else "TranscriptTextDoneEvent",
            event.model_dump(exclude_none=True),
        )
    final = client.audio.transcriptions.create(model="whisper-tiny.en", file=("a.wav", spoken[1]))
    assert done[0].text == final.text


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac"])
def test_speech_formats_decode_and_grow_with_the_input(client: openai.OpenAI, fmt: str) -> None:
    short = client.audio.speech.create(model="tts", voice="joe", input="Good morning.", response_format=fmt)
    long = client.audio.speech.create(
        model="tts", voice="joe", input=" ".join(SENTENCES[:2]), response_format=fmt
    )
    assert 0.3 < duration(short.content) < 3.0
    assert duration(long.content) > 2.5 * duration(short.content)
    if fmt in ("wav", "flac", "mp3"):
        samples, rate = sf.read(io.BytesIO(long.content))
        assert rate == 22050 and abs(len(samples) / rate - duration(long.content)) < 0.1


def test_pcm_is_24khz_16bit_and_streamed_wav_says_unknown_length(client: openai.OpenAI) -> None:
    raw = client.audio.speech.with_raw_response.create(
        model="tts", voice="joe", input="Good morning.", response_format="pcm"
    )
    assert raw.headers["x-argosy-sample-rate"] == "24000"
    pcm = np.frombuffer(raw.content, dtype="<i2")
    assert len(raw.content) % 2 == 0 and 0.3 < pcm.size / 24000 < 3.0 and np.abs(pcm).max() > 1000
    # Piper draws noise: two syntheses differ a little, so the WAV is checked on its own
    wav = client.audio.speech.create(
        model="tts", voice="joe", input="Good morning.", response_format="wav"
    ).content
    with wave.open(io.BytesIO(wav)) as reader:  # streamed: the header's length is "unknown"
        assert (
            reader.getframerate() == 22050 and reader.getsampwidth() == 2 and reader.getnframes() >= 2**31 - 1
        )
    assert 0.3 < duration(wav) < 3.0


def test_speech_streams_sentence_by_sentence(server: object) -> None:
    body = {"model": "tts", "voice": "joe", "input": " ".join(SENTENCES), "response_format": "mp3"}
    with httpx.stream("POST", f"{server.base_url}/v1/audio/speech", json=body, timeout=300) as response:  # type: ignore[attr-defined]
        assert response.status_code == 200 and response.headers["content-type"] == "audio/mpeg"
        chunks = [c for c in response.iter_raw() if c]
    assert len(chunks) >= len(SENTENCES)  # one encoded piece per sentence at least
    assert duration(b"".join(chunks)) > 10
    body |= {"stream_format": "sse", "response_format": "wav"}
    with httpx.stream("POST", f"{server.base_url}/v1/audio/speech", json=body, timeout=300) as response:  # type: ignore[attr-defined]
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    import base64

    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(events) > len(SENTENCES) and duration(audio) > 10


def test_openai_voice_names_are_named_degraded(client: openai.OpenAI) -> None:
    raw = client.audio.speech.with_raw_response.create(
        model="tts", voice="alloy", input="Hello.", response_format="wav", instructions="Speak cheerfully."
    )
    assert raw.status_code == 200
    assert raw.headers["x-argosy-degraded"] == "instructions, voice"


def test_audio_models_list_tasks_and_voices(client: openai.OpenAI, server: object) -> None:
    client.audio.speech.create(model="tts", voice="joe", input="Hi.", response_format="wav")  # loaded
    listing = httpx.get(f"{server.base_url}/v1/audio/models").json()["data"]  # type: ignore[attr-defined]
    by_id = {m["id"]: m["capabilities"] for m in listing}
    assert by_id["whisper-tiny.en"]["tasks"] == ["transcribe"] and by_id["whisper-tiny.en"]["languages"] == [
        "en"
    ]
    assert by_id["tts"]["voices"] == ["joe"] and by_id["tts"]["kind"] == "speech"
    assert by_id["tts"]["aliases"] == ["tts-1"]
    one = httpx.get(f"{server.base_url}/v1/audio/models/tts-1").json()  # type: ignore[attr-defined]
    assert one["id"] == "tts"


def _error(call: object) -> tuple[int, dict[str, object]]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()  # type: ignore[operator]
    return caught.value.status_code, caught.value.body  # type: ignore[return-value]


def test_refusals_name_what_is_missing(client: openai.OpenAI, spoken: list[bytes], server: object) -> None:
    t = client.audio.transcriptions
    cases = [
        (lambda: t.create(model="whisper-tiny.en", file=("a.wav", b"")), "file", "empty"),
        (
            lambda: t.create(model="whisper-tiny.en", file=("a.wav", b"RIFF not really" * 64)),
            "file",
            "decoded",
        ),
        (
            lambda: client.audio.translations.create(model="whisper-tiny.en", file=("a.wav", spoken[0])),
            "model",
            "translate",
        ),
        (
            lambda: t.create(model="whisper-tiny.en", file=("a.wav", spoken[0]), language="de"),
            "language",
            "'de'",
        ),
        (
            lambda: t.create(
                model="whisper-tiny.en", file=("a.wav", spoken[0]), timestamp_granularities=["word"]
            ),
            "timestamp_granularities",
            "verbose_json",
        ),
        (
            lambda: t.create(
                model="whisper-tiny.en", file=("a.wav", spoken[0]), response_format="srt", stream=True
            ),
            "stream",
            "srt",
        ),
        (lambda: t.create(model="tts", file=("a.wav", spoken[0])), "model", "speech model"),
        (lambda: client.audio.speech.create(model="tts", voice="nobody", input="Hi."), "voice", "joe"),
        (lambda: client.audio.speech.create(model="tts", voice="joe", input="x" * 4097), "input", "4096"),
        (lambda: client.audio.speech.create(model="tts", voice="joe", input="  "), "input", "text"),
        (
            lambda: client.audio.speech.create(model="whisper-tiny.en", voice="joe", input="Hi."),
            "model",
            "transcription model",
        ),
    ]
    for call, param, words_in_message in cases:
        status, body = _error(call)
        assert status == 400 and body["param"] == param, body
        assert words_in_message in str(body["message"]), body
    # no model of the kind: 404 naming it; JSON where multipart belongs: 400 naming file
    status, body = _error(lambda: t.create(model="whisper-large", file=("a.wav", spoken[0])))
    assert status == 404 and body["param"] == "model"
    response = httpx.post(f"{server.base_url}/v1/audio/transcriptions", json={"model": "whisper-tiny.en"})  # type: ignore[attr-defined]
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


def test_audio_caps(client: openai.OpenAI, spoken: list[bytes], server: object) -> None:
    # 30 s of audio (over --max-audio-seconds 25) in a small file: 400 naming file
    silence = np.zeros(16000 * 30, dtype=np.int16)
    buffer = io.BytesIO()
    sf.write(buffer, silence, 16000, format="FLAC")
    status, body = _error(
        lambda: client.audio.transcriptions.create(
            model="whisper-tiny.en", file=("s.flac", buffer.getvalue())
        )
    )
    assert status == 400 and body["param"] == "file" and "25 s" in str(body["message"])
    # a body over --max-audio-body-bytes (3M): 413 in OpenAI's error shape
    big = spoken[0] + b"\0" * (3 * 1024 * 1024)
    response = httpx.post(
        f"{server.base_url}/v1/audio/transcriptions",  # type: ignore[attr-defined]
        files={"file": ("big.wav", big)},
        data={"model": "whisper-tiny.en"},
        timeout=60,
    )
    assert response.status_code == 413 and "error" in response.json()
    # above the 1M every non-generation route takes, under 3M: served (a float32 WAV)
    every = np.concatenate([sf.read(io.BytesIO(w), dtype="float32")[0] for w in spoken])
    buffer = io.BytesIO()
    sf.write(buffer, every, 22050, format="WAV", subtype="FLOAT")
    assert 1.1e6 < len(buffer.getvalue()) < 3e6
    text = client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("all.wav", buffer.getvalue())
    ).text
    assert wer([" ".join(SENTENCES)], [text]) <= 0.25


# -- audio jobs -------------------------------------------------------------------------------
def wait_job(base_url: str, job_id: str, timeout_s: float = 300) -> dict[str, object]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        job = httpx.get(f"{base_url}/v1/audio/jobs/{job_id}", timeout=30).json()
        if job["status"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return job  # type: ignore[no-any-return]
        time.sleep(0.3)


def test_jobs_speak_a_document_and_transcribe_a_file(server: object, spoken: list[bytes]) -> None:
    base = server.base_url  # type: ignore[attr-defined]
    document = " ".join(SENTENCES * 15)  # ~4,300 characters: past the 4096 of /v1/audio/speech
    assert len(document) > 4096
    body = {"task": "speech", "model": "tts", "voice": "joe", "input": document, "response_format": "opus"}
    created = httpx.post(f"{base}/v1/audio/generate", json=body, timeout=30)
    assert created.status_code == 202, created.text
    job = created.json()
    assert (
        job["status"] in ("queued", "in_progress")
        and created.headers["location"] == f"/v1/audio/jobs/{job['id']}"
    )
    early = httpx.get(f"{base}/v1/audio/jobs/{job['id']}/result", timeout=30)
    assert early.status_code == 409 and early.json()["error"]["code"] == "job_not_finished"
    finished = wait_job(base, job["id"])
    assert finished["status"] == "completed" and finished["error"] is None, finished
    result = httpx.get(f"{base}/v1/audio/jobs/{job['id']}/result", timeout=60)
    assert result.headers["content-type"] == "audio/ogg" and duration(result.content) > 150
    # a transcription job: multipart, as /v1/audio/transcriptions, its result in the format asked
    files = {"file": ("all.wav", spoken[3])}
    created = httpx.post(
        f"{base}/v1/audio/generate",
        files=files,
        data={"task": "transcription", "model": "whisper-tiny.en", "response_format": "srt"},
        timeout=30,
    )
    assert created.status_code == 202, created.text
    finished = wait_job(base, created.json()["id"])
    assert finished["status"] == "completed", finished
    srt = httpx.get(f"{base}/v1/audio/jobs/{finished['id']}/result", timeout=30)
    assert (
        srt.text.startswith("1\n00:00:00,000 --> ")
        and wer([SENTENCES[3]], [srt.text.split("\n", 2)[2]]) <= 0.2
    )
    deleted = httpx.delete(f"{base}/v1/audio/jobs/{finished['id']}", timeout=30).json()
    assert deleted == {"id": finished["id"], "object": "audio.job.deleted", "deleted": True}
    assert httpx.get(f"{base}/v1/audio/jobs/{finished['id']}", timeout=30).status_code == 404


def test_job_refusals(server: object) -> None:
    base = server.base_url  # type: ignore[attr-defined]
    music = httpx.post(f"{base}/v1/audio/generate", json={"prompt": "a calm piano piece"}, timeout=30)
    assert music.status_code == 400 and music.json()["error"]["code"] == "model_kind_missing"
    assert "'music'" in music.json()["error"]["message"]
    wrong = httpx.post(
        f"{base}/v1/audio/generate",
        json={"task": "speech", "model": "whisper-tiny.en", "voice": "joe", "input": "Hi."},
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_model_kind"
    empty = httpx.post(f"{base}/v1/audio/generate", json={"task": "speech", "voice": "joe", "input": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    bad_voice = httpx.post(
        f"{base}/v1/audio/generate", json={"task": "speech", "voice": "nobody", "input": "Hi."}
    ).json()
    failed = wait_job(base, bad_voice["id"])
    assert failed["status"] == "failed" and "no voice 'nobody'" in failed["error"]["message"]  # type: ignore[index]
    result = httpx.get(f"{base}/v1/audio/jobs/{bad_voice['id']}/result")
    assert result.status_code == 409 and result.json()["error"]["code"] == "job_failed"
    assert httpx.get(f"{base}/v1/audio/jobs/audiojob_nope").status_code == 404


def test_jobs_survive_a_crash_and_restart(server: object) -> None:
    """A finished result and a job cut off mid-run (SIGKILL) are both there after a restart:
    the first as it was, the second run again to completion."""
    base = server.base_url  # type: ignore[attr-defined]
    short = {"task": "speech", "voice": "joe", "input": SENTENCES[0], "response_format": "wav"}
    done_id = httpx.post(f"{base}/v1/audio/generate", json=short).json()["id"]
    assert wait_job(base, done_id)["status"] == "completed"
    before = httpx.get(f"{base}/v1/audio/jobs/{done_id}/result").content
    long = {"task": "speech", "voice": "joe", "input": " ".join(SENTENCES * 15), "response_format": "mp3"}
    cut_id = httpx.post(f"{base}/v1/audio/generate", json=long).json()["id"]
    import time

    while httpx.get(f"{base}/v1/audio/jobs/{cut_id}").json()["status"] != "in_progress":
        time.sleep(0.1)
    server.kill()  # type: ignore[attr-defined]
    server.start()  # type: ignore[attr-defined]  # same port, same data directory
    assert httpx.get(f"{base}/v1/audio/jobs/{done_id}/result").content == before
    rerun = wait_job(base, cut_id)
    assert rerun["status"] == "completed" and rerun["attempts"] == 2, rerun
    assert duration(httpx.get(f"{base}/v1/audio/jobs/{cut_id}/result", timeout=60).content) > 150


# -- realtime ---------------------------------------------------------------------------------
def test_realtime_partials_then_a_final_transcript(server: object, spoken: list[bytes]) -> None:
    import time

    from websockets.sync.client import connect

    pcm, rate = sf.read(io.BytesIO(spoken[2] + b""), dtype="int16")
    url = f"ws://{server.host}:{server.port}/v1/audio/transcriptions/realtime?sample_rate={rate}"  # type: ignore[attr-defined]
    events = []
    with connect(url, open_timeout=60) as ws:
        step = rate // 4  # a quarter second per frame, in real time, as a microphone sends
        for start in range(0, len(pcm), step):
            ws.send(pcm[start : start + step].astype("<i2").tobytes())
            time.sleep(0.25)
        # The first partial was asked for at the first second; on a slow machine it can still
        # be running now, and a commit drops a partial in flight, so wait for it first.
        while not any(e["type"] == "transcript.partial" for e in events):
            events.append(json.loads(ws.recv(timeout=120)))
        ws.send(json.dumps({"type": "not.a.thing"}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while not events or events[-1]["type"] != "transcript.final":
            events.append(json.loads(ws.recv(timeout=120)))
    kinds = [e["type"] for e in events]
    assert "error" in kinds and kinds.count("transcript.final") == 1, kinds
    final = events[-1]
    assert final["item"] == 0 and abs(final["audio_seconds"] - len(pcm) / rate) < 0.05
    assert wer([SENTENCES[2]], [final["text"]]) <= 0.2, final


def test_realtime_refuses_what_it_cannot_serve(server: object) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    base = f"ws://{server.host}:{server.port}/v1/audio/transcriptions/realtime"  # type: ignore[attr-defined]
    for query in ("?model=tts", "?sample_rate=1000", "?language=fr", "?model=nope"):
        with pytest.raises(InvalidStatus) as caught, connect(base + query, open_timeout=60):
            pass
        assert caught.value.response.status_code == 403


def test_load_and_unload_any_model_kind(server: object) -> None:
    import subprocess
    import sys

    base = server.base_url  # type: ignore[attr-defined]
    loaded = httpx.post(f"{base}/v1/argosy/models/tts-1/load", timeout=120).json()
    assert loaded["id"] == "tts" and loaded["capabilities"]["state"] == "loaded"
    stop = subprocess.run(
        [sys.executable, "-m", "argosy", "stop", "tts", "--host", base.removeprefix("http://")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0 and stop.stdout.strip() == "tts unloaded", stop.stderr
    state = httpx.get(f"{base}/v1/audio/models/tts").json()["capabilities"]["state"]
    assert state == "unloaded"
    again = httpx.post(f"{base}/v1/argosy/models/tts/unload", timeout=60).json()
    assert again == {"id": "tts", "object": "model", "unloaded": False, "state": "unloaded"}
    assert httpx.post(f"{base}/v1/argosy/models/nope/load", timeout=60).status_code == 404
