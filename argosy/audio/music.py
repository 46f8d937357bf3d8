"""MusicService: one MusicGen folder (Hugging Face layout: config.json of model_type `musicgen`,
its weights, the T5 tokenizer and processor files) as the core sees it — a model of kind
`music` in the registry, loaded on request, run on its own worker thread
(argosy/core/worker.py), float32 on the CPU, through transformers' MusicGen classes.

`generate(MusicRequest)` makes `duration` seconds of mono audio from a text prompt. MusicGen's
decoder writes one EnCodec code per codebook per frame, each codebook one step behind the one
before it (the delay pattern), so a clip of F frames takes F + codebooks - 1 new tokens; F is
`ceil(duration x frame_rate)` of the folder's audio encoder, and the decoded audio is cut to
`round(duration x sampling_rate)` samples. A stereo model's two channels are mixed to mono
(the encoders downstream write mono).

Sampling is the folder's generation_config.json (MusicGen's own: top-k 250, classifier-free
guidance 3.0). A seed makes it repeatable: the same seed, prompt and duration give the same
samples, as transformers' `generate` gives them after `torch.manual_seed(seed)`. No weights
ship on PyPI, so none is registered by name: a folder is configured as a model.
"""

from __future__ import annotations

import json
import math
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from argosy.core.service import ModelInfo
from argosy.core.worker import WorkerModel
from argosy.errors import ArgosyError, InvalidRequestError, ModelLoadError

MUSICGEN_MODEL_TYPES = ("musicgen",)
MAX_MUSIC_SECONDS = 30.0  # MusicGen trains on 30 s clips; longer needs windowed continuation
DEFAULT_MUSIC_SECONDS = 10.0
MAX_MUSIC_PROMPT_CHARS = 4000

# MusicGen's sampler draws from torch's global RNG (`generate` takes no Generator), which is the
# process's: one music generation at a time seeds and draws from it, inside torch.random.fork_rng
# so the state anyone else sees is left as it was. Argosy's own samplers hold private generators.
_GLOBAL_RNG = threading.Lock()


def is_musicgen_folder(source: str) -> bool:
    path = Path(source).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in MUSICGEN_MODEL_TYPES


@dataclass(frozen=True, slots=True)
class MusicRequest:
    prompt: str
    duration: float  # seconds, in (0, MAX_MUSIC_SECONDS]
    seed: int

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise InvalidRequestError("'prompt' must describe the music.", param="prompt")
        if not 0 < self.duration <= MAX_MUSIC_SECONDS:
            raise InvalidRequestError(
                f"'duration' must be above 0 and at most {MAX_MUSIC_SECONDS:g} seconds, got {self.duration}.",
                param="duration",
            )


class MusicService(WorkerModel):
    kind = "music"

    def __init__(self, model_id: str, folder: str, created: int | None = None) -> None:
        import torch
        from transformers import AutoProcessor, MusicgenForConditionalGeneration

        self._start_worker(model_id, created)
        self.path = Path(folder).expanduser()
        try:
            self.model: Any = MusicgenForConditionalGeneration.from_pretrained(
                str(self.path), dtype=torch.float32
            ).eval()
            self.processor: Any = AutoProcessor.from_pretrained(str(self.path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot load the MusicGen folder {self.path}: {exc}") from exc
        audio = self.model.config.audio_encoder
        decoder = self.model.config.decoder
        self.sample_rate = int(audio.sampling_rate)
        self.frame_rate = int(audio.frame_rate)
        self.num_channels = int(decoder.audio_channels)
        # codebooks per channel: the delay pattern's depth
        self.num_codebooks = int(decoder.num_codebooks) // self.num_channels

    def model_info(self, state: str = "loaded") -> ModelInfo:
        channels = "mono" if self.num_channels == 1 else "stereo mixed to mono"
        return self._info(
            state,
            architecture="MusicgenForConditionalGeneration",
            dtype="float32",
            quantization=None,
            memory_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            tasks=("music",),
            description=(
                f"MusicGen ({self.path.name}), {self.sample_rate} Hz {channels}, "
                f"{self.frame_rate} frames/s, up to {MAX_MUSIC_SECONDS:g} s"
            ),
        )

    @staticmethod
    def draw_seed() -> int:
        return random.randrange(2**31)

    def max_new_tokens(self, duration: float) -> int:
        """The decoder steps that cover `duration` seconds: its frames plus the delay pattern's."""
        return math.ceil(duration * self.frame_rate) + self.num_codebooks - 1

    def num_samples(self, duration: float) -> int:
        return round(duration * self.sample_rate)

    async def generate(self, request: MusicRequest) -> np.ndarray:
        """`request.duration` seconds of mono float32 samples at `sample_rate` (about [-1, 1]).
        A caller that stops waiting (a job cancelled) stops the decoder at its next step."""
        stop = threading.Event()
        try:
            return await self.worker.call(lambda: self.samples(request, stop))
        finally:
            stop.set()

    def samples(self, request: MusicRequest, stop: threading.Event | None = None) -> np.ndarray:
        """What `generate` returns, computed on the calling thread."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Stopped(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                is_set = stop is not None and stop.is_set()
                return torch.full((input_ids.shape[0],), is_set, dtype=torch.bool, device=input_ids.device)

        inputs = self.processor(text=[request.prompt], padding=True, return_tensors="pt")
        stopped = ArgosyError("music generation was stopped: nobody waits for it any more")
        try:
            with _GLOBAL_RNG, torch.random.fork_rng(devices=[]), torch.inference_mode():
                torch.manual_seed(request.seed)
                audio = self.model.generate(
                    **inputs,
                    max_new_tokens=self.max_new_tokens(request.duration),
                    stopping_criteria=StoppingCriteriaList([_Stopped()]),
                )
        except RuntimeError as exc:  # stopped short, the delay pattern's frames do not line up
            if stop is not None and stop.is_set():
                raise stopped from exc
            raise
        if stop is not None and stop.is_set():
            raise stopped
        samples = audio[0].float().mean(dim=0) if self.num_channels > 1 else audio[0, 0].float()
        return samples[: self.num_samples(request.duration)].numpy().astype(np.float32, copy=False)


def pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples (about [-1, 1]) as int16, clipped: what the audio encoders take."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
