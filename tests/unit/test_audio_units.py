"""The audio pieces that need no model: decoding uploads, encoding speech chunk by chunk,
subtitles, the worker queue, form bodies, audio sources and kinds."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import time

import numpy as np
import pytest

from argosy.audio import subtitles
from argosy.audio.sources import AUDIO_REGISTRY, audio_kind, audio_source, require_audio_library
from argosy.core.worker import ModelWorker
from argosy.errors import InvalidRequestError, ModelLoadError, OverloadedError

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")

from argosy.audio.codecs import SPEECH_FORMATS, AudioEncoder, decode_upload, encode_all, wav_header  # noqa: E402


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * freq * t) * 12000).astype(np.int16)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def decoded_seconds(data: bytes) -> tuple[float, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return sum(f.samples for f in container.decode(stream)) / stream.rate, stream.rate


# -- decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_uploads_decode_to_16k_mono_float(fmt: str) -> None:
    buffer = io.BytesIO()
    stereo = np.stack([tone(2.0, 44100), tone(2.0, 44100, 660)], axis=1)
    sf.write(buffer, stereo, 44100, format=fmt)
    samples = decode_upload(buffer.getvalue())
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.size / 16000 - 2.0) < 0.08  # mp3 pads a frame or so
    # a lossy codec overshoots a full-scale peak (MP3 read 1.02 and 1.06 in two runs on an AVX2 EPYC)
    assert 0.2 < np.abs(samples).max() <= (1.2 if fmt in ("MP3", "OGG") else 1.0)


def test_empty_corrupt_and_silent_uploads_name_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="empty") as caught:
        decode_upload(b"", param="file")
    assert caught.value.param == "file"
    with pytest.raises(InvalidRequestError, match="could not be decoded") as caught:
        decode_upload(b"\x00\x01garbage" * 100, param="file")
    assert caught.value.param == "file"
    with pytest.raises(InvalidRequestError, match="no audio"):
        decode_upload(wav_header(16000, 0), param="file")


def test_the_duration_cap_is_checked_before_everything_is_decoded() -> None:
    data = wav_bytes(tone(12.0, 16000), 16000)
    assert decode_upload(data, max_seconds=13).size == 12 * 16000
    with pytest.raises(InvalidRequestError, match="12 s of audio; this server takes at most 10 s"):
        decode_upload(data, max_seconds=10)


# -- encoding ---------------------------------------------------------------------------------
def test_wav_header_fields() -> None:
    header = wav_header(22050, 100)
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt " and len(header) == 44
    assert struct.unpack("<I", header[4:8])[0] == 36 + 200
    assert struct.unpack("<IHHIIHH", header[16:36]) == (16, 1, 1, 22050, 44100, 2, 16)
    assert struct.unpack("<I", header[40:44])[0] == 200
    assert struct.unpack("<I", wav_header(22050, None)[40:44])[0] == 0xFFFFFFFF


@pytest.mark.parametrize("name", ["wav", "mp3", "opus", "aac", "flac"])
def test_each_format_round_trips_and_streams(name: str) -> None:
    fmt = SPEECH_FORMATS[name]
    chunks = [tone(0.5, 22050, f) for f in (300, 500, 700, 900)]
    whole = encode_all(chunks, fmt, 22050)
    seconds, rate = decoded_seconds(whole)
    assert abs(seconds - 2.0) < 0.1 and rate == (fmt.rate or 22050)
    encoder = AudioEncoder(fmt, 22050, streaming=True)
    pieces = [encoder.add(chunk) for chunk in chunks]
    pieces.append(encoder.finish())
    streamed = b"".join(pieces)
    assert abs(decoded_seconds(streamed)[0] - 2.0) < 0.1
    if name in ("wav", "mp3", "aac"):  # bytes leave as the chunks come, not all at the end
        assert sum(1 for piece in pieces[:-1] if piece) >= 3
    if name == "flac":  # built whole: the header (written last) holds the sample count
        assert not any(pieces[:-1]) and sf.info(io.BytesIO(streamed)).frames == 2 * 22050


def test_pcm_is_raw_24k_and_whole_wav_has_its_length() -> None:
    chunks = [tone(1.0, 22050)]
    pcm = encode_all(chunks, SPEECH_FORMATS["pcm"], 22050)
    assert abs(len(pcm) / 2 - 24000) < 100
    wav = encode_all(chunks, SPEECH_FORMATS["wav"], 22050)
    info = sf.info(io.BytesIO(wav))
    assert info.frames == 22050 and info.samplerate == 22050 and len(wav) == 44 + 2 * 22050


# -- subtitles --------------------------------------------------------------------------------
class _Cue:
    def __init__(self, start: float, end: float, text: str) -> None:
        self.start, self.end, self.text = start, end, text


def test_srt_and_vtt() -> None:
    cues = [_Cue(0.0, 2.5, " Hello there."), _Cue(3661.0416, 3662.5, " Second\n\nline ")]
    assert subtitles.srt(cues) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n01:01:01,042 --> 01:01:02,500\nSecond\nline\n"
    )
    assert subtitles.vtt(cues) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n01:01:01.042 --> 01:01:02.500\nSecond\nline\n"
    )
    assert subtitles.srt([]) == "" and subtitles.vtt([]) == "WEBVTT\n"


# -- the worker queue -------------------------------------------------------------------------
def test_worker_runs_one_at_a_time_in_order_and_bounds_its_queue() -> None:
    worker = ModelWorker("m", max_waiting=2)
    order: list[str] = []
    running = threading.Semaphore(1)

    def job(name: str) -> str:
        assert running.acquire(blocking=False), "two jobs ran at once"
        time.sleep(0.05)
        order.append(name)
        running.release()
        return name

    async def main() -> None:
        first = asyncio.ensure_future(worker.call(lambda: job("a")))
        await asyncio.sleep(0.01)  # a is running
        second = asyncio.ensure_future(worker.call(lambda: job("b")))
        third = asyncio.ensure_future(worker.call(lambda: job("c")))
        await asyncio.sleep(0)
        assert worker.waiting == 2
        with pytest.raises(OverloadedError, match="2 requests waiting"):
            await worker.call(lambda: job("d"))
        assert await asyncio.gather(first, second, third) == ["a", "b", "c"]

    asyncio.run(main())
    assert order == ["a", "b", "c"] and worker.waiting == 0 and worker.running == 0
    worker.shutdown()


def test_worker_streams_items_and_stops_when_the_consumer_leaves() -> None:
    worker = ModelWorker("m")
    produced: list[int] = []

    def make() -> object:
        for i in range(100):
            produced.append(i)
            time.sleep(0.005)
            yield i

    async def main() -> list[int]:
        got = []
        stream = worker.iterate(make)  # type: ignore[arg-type]
        async for item in stream:
            got.append(item)
            if item == 2:
                break
        await stream.aclose()
        await asyncio.sleep(0.1)
        return got

    assert asyncio.run(main()) == [0, 1, 2]
    assert len(produced) < 10  # the generator stopped at its next item

    def failing() -> object:
        yield 1
        raise ValueError("boom")

    async def consume() -> list[int]:
        return [item async for item in worker.iterate(failing)]  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(consume())
    worker.shutdown()


# -- sources ----------------------------------------------------------------------------------
def test_audio_kinds_of_sources(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    assert audio_kind("whisper-tiny.en") == "transcription" and audio_kind("piper-joe") == "speech"
    assert audio_kind("espeak") == "speech" and audio_kind("smollm2") is None
    whisper = root / "my-whisper"
    whisper.mkdir()
    (whisper / "model.bin").write_bytes(b"x")
    (whisper / "config.json").write_text('{"alignment_heads": [[1, 0]]}')
    assert audio_kind(str(whisper)) == "transcription"
    (root / "v.onnx").write_bytes(b"x")
    assert audio_source(str(root / "v.onnx")) is None  # no .onnx.json beside it
    (root / "v.onnx.json").write_text("{}")
    assert audio_kind(str(root / "v.onnx")) == "speech"
    assert audio_kind("whisper-base") == "transcription"
    assert set(AUDIO_REGISTRY) == {"whisper-tiny.en", "whisper-base", "piper-joe", "espeak"}


def test_a_missing_audio_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "piper", None)  # `import piper` raises ImportError
    with pytest.raises(
        ModelLoadError, match=r"speech synthesis needs the Python package piper.*argosy\[audio\]"
    ):
        require_audio_library("piper", "speech synthesis")
