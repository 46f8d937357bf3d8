"""Audio in and out: an upload decoded to what a recogniser reads, synthesised samples encoded
as the format a client asked for, chunk by chunk so speech can stream.

Decoding goes through PyAV (FFmpeg's demuxers and decoders: wav, mp3, flac, ogg/opus, webm,
m4a/aac, ...), resampled to 16 kHz mono float32. A file that is empty, not audio, or longer
than the cap is an InvalidRequestError naming the form field, never a 500.

Encoding: `wav` (16-bit PCM; a streamed one declares an unknown length, as streaming WAV
writers do), `pcm` (raw 16-bit little-endian at 24 kHz, as OpenAI's `pcm` is), and `mp3`,
`opus` (in Ogg), `aac` (ADTS) through PyAV's encoders into a sink that is drained after every
chunk, so bytes leave as soon as the encoder lets them. `flac` is built whole (its header,
written last, holds the sample count a decoder needs) and sent at the end.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from argosy.errors import InvalidRequestError

RECOGNISER_RATE = 16_000  # what Whisper reads
PCM_RATE = 24_000  # OpenAI's `pcm`: 24 kHz, 16-bit signed little-endian, mono


@dataclass(frozen=True, slots=True)
class OutputFormat:
    name: str
    media_type: str
    container: str | None  # PyAV's muxer; None: written here (wav, pcm)
    codec: str | None
    rate: int | None = None  # a fixed output rate (opus: 48 kHz; pcm: 24 kHz); None: the voice's
    # the muxer writes its header last (FLAC's STREAMINFO holds the sample count and MD5): the
    # file is built whole and sent at the end, streamed or not
    is_whole: bool = False


SPEECH_FORMATS: dict[str, OutputFormat] = {
    "wav": OutputFormat("wav", "audio/wav", None, None),
    "pcm": OutputFormat("pcm", "audio/pcm", None, None, PCM_RATE),
    "mp3": OutputFormat("mp3", "audio/mpeg", "mp3", "libmp3lame"),
    "opus": OutputFormat("opus", "audio/ogg", "ogg", "libopus", 48_000),
    "aac": OutputFormat("aac", "audio/aac", "adts", "aac"),
    "flac": OutputFormat("flac", "audio/flac", "flac", "flac", is_whole=True),
}


def decode_upload(data: bytes, *, param: str = "file", max_seconds: float | None = None) -> np.ndarray:
    """An uploaded file as 16 kHz mono float32 samples in [-1, 1]."""
    import av

    if not data:
        raise InvalidRequestError(f"'{param}' is empty: send an audio file.", param=param)
    chunks: list[np.ndarray] = []
    total = 0
    limit = None if max_seconds is None else int(max_seconds * RECOGNISER_RATE)
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise InvalidRequestError(f"'{param}' holds no audio stream.", param=param)
            stream = container.streams.audio[0]
            declared = (
                float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
            )
            if max_seconds is not None and declared is not None and declared > max_seconds:
                raise _too_long(param, declared, max_seconds)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=RECOGNISER_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    chunks.append(samples)
                    total += samples.size
                if limit is not None and total > limit:
                    raise _too_long(param, total / RECOGNISER_RATE, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except InvalidRequestError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OSError) as exc:
        raise InvalidRequestError(
            f"'{param}' could not be decoded as audio ({type(exc).__name__}: {exc}).", param=param
        ) from None
    samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InvalidRequestError(f"'{param}' decodes to no audio samples.", param=param)
    return samples


def _too_long(param: str, seconds: float, cap: float | None) -> InvalidRequestError:
    return InvalidRequestError(
        f"'{param}' is {seconds:.0f} s of audio; this server takes at most {cap:.0f} s per request "
        "(--max-audio-seconds; a longer file can run as an audio job, POST /v1/audio/generate).",
        param=param,
    )


def duration_of(samples: np.ndarray, rate: int = RECOGNISER_RATE) -> float:
    return float(samples.size) / rate


class _Sink:
    """A write-only file for PyAV's muxer (no seek: it writes as a stream)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


def wav_header(rate: int, num_samples: int | None) -> bytes:
    """A 16-bit mono PCM WAV header; num_samples None: a stream of unknown length."""
    data_bytes = 0xFFFFFFFF if num_samples is None else num_samples * 2
    riff_bytes = 0xFFFFFFFF if num_samples is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


class AudioEncoder:
    """Encodes mono int16 chunks at `rate` as `fmt`: `add(chunk)` returns the bytes ready now,
    `finish()` the rest. `streaming` False lets a WAV header carry its real length (the
    samples are then held until `finish`)."""

    def __init__(self, fmt: OutputFormat, rate: int, *, streaming: bool) -> None:
        self.fmt = fmt
        self.rate = rate
        self.streaming = streaming
        self._held: list[bytes] = []
        self._num_samples = 0
        self._started = False
        self._resampler: Any = None
        self._container: Any = None
        self._stream: Any = None
        self._sink: Any = io.BytesIO() if fmt.is_whole else _Sink()
        out_rate = fmt.rate or rate
        if fmt.container is not None or out_rate != rate:
            import av

            if fmt.container is not None:
                self._container = av.open(self._sink, mode="w", format=fmt.container)
                self._stream = self._container.add_stream(fmt.codec, rate=out_rate, layout="mono")
                target = self._stream.format.name
            else:
                target = "s16"
            self._resampler = av.AudioResampler(format=target, layout="mono", rate=out_rate)

    @property
    def output_rate(self) -> int:
        return self.fmt.rate or self.rate

    def add(self, chunk: np.ndarray) -> bytes:
        pcm = np.ascontiguousarray(chunk, dtype=np.int16).reshape(-1)
        if self._resampler is not None:
            return self._push(pcm)
        if self.fmt.name == "pcm":
            return pcm.tobytes()
        # wav
        self._num_samples += pcm.size
        if not self.streaming:
            self._held.append(pcm.tobytes())
            return b""
        head = b"" if self._started else wav_header(self.rate, None)
        self._started = True
        return head + pcm.tobytes()

    def finish(self) -> bytes:
        if self._resampler is not None:
            return self._push(None)
        if self.fmt.name == "wav" and not self.streaming:
            return wav_header(self.rate, self._num_samples) + b"".join(self._held)
        if self.fmt.name == "wav" and not self._started:
            return wav_header(self.rate, 0 if not self.streaming else None)
        return b""

    def _push(self, pcm: np.ndarray | None) -> bytes:
        import av

        frames = []
        if pcm is not None:
            frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
            frame.sample_rate = self.rate
            frames = self._resampler.resample(frame)
        else:
            frames = self._resampler.resample(None)
        if self._container is None:  # pcm at its own rate
            return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        if pcm is None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        if self.fmt.is_whole:
            return self._sink.getvalue() if pcm is None else b""
        return self._sink.take()


def encode_all(chunks: list[np.ndarray], fmt: OutputFormat, rate: int) -> bytes:
    """Every chunk encoded as one file (a WAV header with its real length)."""
    encoder = AudioEncoder(fmt, rate, streaming=False)
    return b"".join([*(encoder.add(chunk) for chunk in chunks), encoder.finish()])
