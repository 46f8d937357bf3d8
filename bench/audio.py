"""Audio benchmark: Argosy's /v1/audio/transcriptions and /v1/audio/speech over HTTP vs
faster-whisper and piper called directly in this process, same models, same CPU, same run.

    .venv/bin/python bench/audio.py [--rounds 3] [--threads 2]   # starts its own server
    .venv/bin/python bench/audio.py --url http://127.0.0.1:8000   # a running server instead

Test material, made once: eight fixed English sentences (8-20 words, no numbers, so the word
error rate is not about "4" vs "four") spoken by piper (en_US-joe-medium, 16-bit 22.05 kHz WAV).
Transcription: each WAV is transcribed, directly by a WhisperModel with Argosy's settings (int8,
cpu_threads=--threads, num_workers=1, language "en", the default temperature fallback, no VAD,
decoded from the WAV bytes with PyAV as Argosy does) and by Argosy through the openai client.
Speech: each sentence is spoken, directly by PiperVoice.synthesize (int16 + a WAV header; piper
picks onnxruntime's threads itself, on the server too) and by Argosy (response_format wav).
Concurrency 1 sends the sentences one after another; concurrency 4 has 4 lanes (4 openai
clients; directly, 4 threads sharing one model) each sending every 4th sentence back to back.
Argosy runs one audio request at a time per model (requests queue); faster-whisper with
num_workers=1 serialises its decoder too: concurrency 4 shows what each does, nothing hidden.

Figures: RTF = request wall seconds / seconds of audio (transcription: audio in; speech: audio
produced), summed over requests (lower is better; queueing raises it); throughput = seconds of
audio per wall second for the whole set (higher is better; batching raises it). The sides take
turns (order swapped every round, a half-second pause between, so idle library threads spinning
down hit neither) and each figure is the median over --rounds. Warm-ups (one request per side,
the first loads Argosy's model) are not timed. The sanity line is the word error rate of each
side's transcripts against the source sentences (lowercased, punctuation stripped). The own
server serves the two audio models only (no chat model compiling in the background), on
127.0.0.1 with --threads, and is killed at exit. Results: bench/results/audio-<time>.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import numpy as np  # noqa: E402
import peers  # noqa: E402
from host import machine_line  # noqa: E402

from argosy.audio.codecs import wav_header  # noqa: E402
from argosy.audio.sources import AUDIO_REGISTRY  # noqa: E402

SENTENCES = (
    "The weather this morning is cool and cloudy, with light rain expected to clear by the afternoon.",
    "Slice the onions thinly and cook them slowly in butter until they turn soft and golden.",
    "The evening train to the coast is running late, so passengers should wait on the other platform.",
    "Please add a pinch of salt to the soup and stir it gently before serving.",
    "A strong wind is blowing from the north, so bring a warm coat if you go outside.",
    "The library closes early on Sundays, but the reading room stays open until late in the evening.",
    "Our flight was delayed because of fog, and we spent the whole morning waiting at the gate.",
    "She baked fresh bread with honey and walnuts, and the kitchen smelled wonderful all day.",
)
WHISPER, PIPER, VOICE = "whisper-tiny.en", "piper-joe", "joe"
CONCURRENCY = (1, 4)
# one request: (lane, item) -> (seconds of audio, transcript or None)
Request = Callable[[int, Any], tuple[float, str | None]]


def wav_seconds(data: bytes) -> float:
    """Seconds in a 16-bit mono WAV (a streamed one's header says 'unknown length')."""
    rate = int.from_bytes(data[24:28], "little")
    start = data.index(b"data", 12) + 8
    return (len(data) - start) // 2 / rate


class Direct:
    """faster-whisper and piper in this process, loaded as Argosy loads them."""

    def __init__(self, threads: int) -> None:
        from faster_whisper import WhisperModel
        from piper import PiperVoice

        self.whisper = WhisperModel(
            str(AUDIO_REGISTRY[WHISPER].locate()), device="cpu", compute_type="int8",
            cpu_threads=threads, num_workers=1,
        )  # fmt: skip
        self.voice = PiperVoice.load(AUDIO_REGISTRY[PIPER].locate())
        self.rate = int(self.voice.config.sample_rate)

    def speak(self, text: str) -> bytes:
        samples = np.concatenate([c.audio_int16_array for c in self.voice.synthesize(text)])
        return wav_header(self.rate, samples.size) + samples.astype("<i2").tobytes()

    def transcribe(self, _lane: int, wav: bytes) -> tuple[float, str | None]:
        from faster_whisper import decode_audio

        samples = decode_audio(io.BytesIO(wav))
        segments, _ = self.whisper.transcribe(samples, language="en", vad_filter=False)
        return wav_seconds(wav), "".join(s.text for s in segments).strip()

    def speech(self, _lane: int, text: str) -> tuple[float, str | None]:
        return wav_seconds(self.speak(text)), None


class Remote:
    """Argosy over HTTP: one openai client per lane."""

    def __init__(self, url: str, api_key: str, lanes: int) -> None:
        from openai import OpenAI

        base = url.rstrip("/") + "/v1"
        self.clients = [
            OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=600) for _ in range(lanes)
        ]

    def transcribe(self, lane: int, wav: bytes) -> tuple[float, str | None]:
        answer = self.clients[lane].audio.transcriptions.create(model=WHISPER, file=("s.wav", wav))
        return wav_seconds(wav), answer.text.strip()

    def speech(self, lane: int, text: str) -> tuple[float, str | None]:
        answer = self.clients[lane].audio.speech.create(
            model=PIPER, voice=VOICE, input=text, response_format="wav"
        )
        return wav_seconds(answer.content), None


def run_set(request: Request, items: list[Any], concurrency: int) -> dict[str, Any]:
    """Every item once, `concurrency` lanes each sending every n-th item back to back."""
    latencies: list[float] = [0.0] * len(items)
    audio: list[float] = [0.0] * len(items)
    texts: list[str | None] = [None] * len(items)

    def lane(index: int) -> None:
        for i in range(index, len(items), concurrency):
            t0 = time.perf_counter()
            audio[i], texts[i] = request(index, items[i])
            latencies[i] = time.perf_counter() - t0

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(lane, n) for n in range(concurrency)]
    wall = time.perf_counter() - start
    for future in futures:
        future.result()  # a failed request fails the run
    return {
        "rtf": sum(latencies) / sum(audio),
        "throughput": sum(audio) / wall,
        "wall_s": wall,
        "audio_s": sum(audio),
        "max_latency_s": max(latencies),
        "texts": texts,
    }


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def word_error_rate(hypotheses: list[str], references: list[str]) -> float:
    errors = total = 0
    for hyp_text, ref_text in zip(hypotheses, references, strict=True):
        hyp, ref = words(hyp_text), words(ref_text)
        row = list(range(len(hyp) + 1))
        for i, ref_word in enumerate(ref, 1):
            prev, row[0] = row[0], i
            for j, hyp_word in enumerate(hyp, 1):
                prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ref_word != hyp_word))
        errors += row[-1]
        total += len(ref)
    return errors / total


def start_server(threads: int, run_dir: Path) -> peers.RunningServer:
    def command(ctx: peers.LaunchContext) -> list[str]:
        return [
            sys.executable, "-m", "argosy", "serve", "--model", WHISPER, "--model", PIPER,
            "--host", peers.HOST, "--port", str(ctx.port), "--threads", str(ctx.threads),
            "--data-dir", str(ctx.run_dir / "argosy-data"),
        ]  # fmt: skip

    spec = peers.ServerSpec("argosy", "Argosy", None, command, lambda m: m.name, lambda m, n: {})
    model = peers.ModelFiles(WHISPER, Path(), Path(), ())  # the command names its own models
    ctx = peers.LaunchContext(model=model, threads=threads, port=peers.free_port(), slots=1, run_dir=run_dir)
    return peers.RunningServer(spec, ctx)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="the server's --threads and faster-whisper's")
    parser.add_argument("--url", help="measure this running server (its own threads) instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("ARGOSY_API_KEY", "argosy-bench"))
    parser.add_argument("--tasks", default="transcription,speech", help="which of the two to measure")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/audio-<time>.json)")
    args = parser.parse_args()

    print(
        f"# CPU: {machine_line()}; threads {args.threads}; load average {os.getloadavg()[0]:.2f}", flush=True
    )
    direct = Direct(args.threads)
    wavs = [direct.speak(text) for text in SENTENCES]
    audio_s = sum(wav_seconds(wav) for wav in wavs)
    print(
        f"# material: {len(wavs)} sentences, {audio_s:.1f} s of piper speech at {direct.rate} Hz", flush=True
    )

    scratch = tempfile.TemporaryDirectory(prefix="argosy-audio-bench-")
    server = None if args.url else start_server(args.threads, Path(scratch.name))
    url = server.base_url if server else args.url
    print(f"# Argosy: {url} ({'given' if args.url else 'started here'}: {WHISPER}, {PIPER})", flush=True)
    remote = Remote(url, args.api_key, max(CONCURRENCY))
    tasks: dict[str, tuple[list[Any], dict[str, Request]]] = {
        "transcription": (wavs, {"direct": direct.transcribe, "argosy": remote.transcribe}),
        "speech": (list(SENTENCES), {"direct": direct.speech, "argosy": remote.speech}),
    }
    tasks = {task: tasks[task] for task in args.tasks.split(",")}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for items, sides in tasks.values():  # warm-up, untimed: the first Argosy call loads the model
            for request in sides.values():
                request(0, items[0])
        for round_index in range(args.rounds):
            for task, (items, sides) in tasks.items():
                for concurrency in CONCURRENCY:
                    order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
                    for side in order:
                        time.sleep(0.5)
                        figures = run_set(sides[side], items, concurrency)
                        runs.setdefault(f"{task}/{concurrency}/{side}", []).append(figures)
                        print(
                            f"round {round_index + 1} {task:>13} c{concurrency} {side:>6}: RTF "
                            f"{figures['rtf']:.3f}, {figures['throughput']:.2f} audio-s/s, "
                            f"wall {figures['wall_s']:.1f} s",
                            flush=True,
                        )
    finally:
        if server is not None:
            server.stop()
        scratch.cleanup()

    def median(key: str, figure: str) -> float:
        return statistics.median(float(run[figure]) for run in runs[key])

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    print(f"\n# Audio, {time.strftime('%Y-%m-%d %H:%M')}; CPU: {machine_line()}; threads {args.threads}")
    print(f"(median of {args.rounds} rounds; RTF: lower is better; audio-s/s: higher is better)\n")
    print(
        "| Task | Concurrency | Direct RTF | Argosy RTF | Argosy/direct | Direct audio-s/s | Argosy audio-s/s | Argosy/direct |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for task in tasks:
        for concurrency in CONCURRENCY:
            key = f"{task}/{concurrency}"
            d_rtf, a_rtf = median(f"{key}/direct", "rtf"), median(f"{key}/argosy", "rtf")
            d_tp, a_tp = median(f"{key}/direct", "throughput"), median(f"{key}/argosy", "throughput")
            rows.append({"task": task, "concurrency": concurrency, "direct_rtf": d_rtf, "argosy_rtf": a_rtf,
                         "direct_throughput": d_tp, "argosy_throughput": a_tp})  # fmt: skip
            print(
                f"| {task} | {concurrency} | {d_rtf:.3f} | {a_rtf:.3f} | {a_rtf / d_rtf:.2f} | "
                f"{d_tp:.2f} | {a_tp:.2f} | {a_tp / d_tp:.2f} |"
            )
            if concurrency == 1:
                verdict = "within" if a_rtf <= 1.10 * d_rtf else "NOT within"
                notes.append(f"{task} at concurrency 1: Argosy {a_rtf / d_rtf:.2f}x direct ({verdict} 10%)")
    print("\n".join(notes))
    wer: dict[str, float] = {}
    for side in ("direct", "argosy"):
        done = [
            run
            for key, rs in runs.items()
            if key.startswith("transcription/") and key.endswith(side)
            for run in rs
        ]
        if done:
            texts = [str(text) for run in done for text in run["texts"]]
            wer[side] = word_error_rate(texts, list(SENTENCES) * len(done))
    if wer:
        print(f"WER vs the source sentences: Argosy {wer['argosy']:.1%}, direct {wer['direct']:.1%}")
    if server is not None:
        print(
            f"server peak RSS {server.peak_rss_mib or 0:.0f} MiB; other processes used "
            f"{server.other_cpu_percent or 0:.1f}% of the CPU meanwhile"
        )

    out = args.out or BENCH_DIR / "results" / f"audio-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "cpu": machine_line(),
        "threads": args.threads,
        "rounds": args.rounds,
        "server": args.url or "started",
        "material_audio_s": audio_s,
        "sentences": SENTENCES,
        "table": rows,
        "wer": wer,
        "runs": runs,
        "server_peak_rss_mib": server.peak_rss_mib if server else None,
        "other_cpu_percent": server.other_cpu_percent if server else None,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"# written to {out}")


if __name__ == "__main__":
    main()
