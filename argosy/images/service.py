"""ImageService: one diffusers pipeline folder (a `model_index.json` beside its components) as
the core sees it — a model of kind `image` in the registry, loaded on request, run on its
own worker thread (argosy/core/worker.py), float32 on the CPU.

`generate` makes `n` images of `width` x `height` from a prompt; a seed makes it repeatable
(the same seed, prompt and parameters give the same pixels: one torch Generator seeded per
request), and without one a seed is drawn and reported. No diffusion model ships on PyPI, so
none is registered by name: a folder is configured in the models file.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argosy.core.service import ModelInfo
from argosy.core.worker import WorkerModel
from argosy.errors import ModelLoadError

IMAGES_EXTRA = "pip install 'argosy[images]'"


def is_diffusers_folder(source: str) -> bool:
    path = Path(source).expanduser()
    return path.is_dir() and (path / "model_index.json").is_file()


@dataclass(frozen=True, slots=True)
class ImageRequest:
    prompt: str
    n: int
    width: int
    height: int
    seed: int
    steps: int
    guidance_scale: float
    negative_prompt: str | None = None


class ImageService(WorkerModel):
    kind = "image"

    def __init__(self, model_id: str, folder: str, created: int | None = None) -> None:
        try:
            from diffusers import DiffusionPipeline
        except ImportError as exc:
            raise ModelLoadError(
                f"image generation needs the Python package diffusers ({exc}): {IMAGES_EXTRA}"
            ) from exc
        import torch

        self._start_worker(model_id, created)
        self.path = Path(folder).expanduser()
        try:
            self.pipeline: Any = DiffusionPipeline.from_pretrained(str(self.path), torch_dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the diffusers pipeline in {self.path}: {exc}") from exc
        self.pipeline.set_progress_bar_config(disable=True)
        index = json.loads((self.path / "model_index.json").read_text())
        self.architecture = str(index.get("_class_name", "DiffusionPipeline"))
        unet = getattr(self.pipeline, "unet", None)
        scale = getattr(self.pipeline, "vae_scale_factor", 8)
        sample = getattr(getattr(unet, "config", None), "sample_size", None)
        self.default_size = int(sample * scale) if isinstance(sample, int) else 512

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return self._info(
            state,
            architecture=self.architecture,
            dtype="float32",
            quantization=None,
            memory_bytes=sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file()),
            tasks=("generate",),
            description=f"diffusers {self.architecture} ({self.path.name}), {self.default_size}px native",
        )

    @staticmethod
    def draw_seed() -> int:
        return random.randrange(2**31)

    async def generate(self, request: ImageRequest, output_format: str = "png") -> list[bytes]:
        """The images, encoded (png, jpeg or webp)."""
        return await self.worker.call(lambda: self._generate(request, output_format))

    def _generate(self, request: ImageRequest, output_format: str) -> list[bytes]:
        import torch

        # torch's intra-op threads are the process's (--threads), shared with the chat engines
        generator = torch.Generator("cpu").manual_seed(request.seed)
        with torch.inference_mode():
            result = self.pipeline(
                prompt=request.prompt,
                negative_prompt=request.negative_prompt,
                num_images_per_prompt=request.n,
                width=request.width,
                height=request.height,
                num_inference_steps=request.steps,
                guidance_scale=request.guidance_scale,
                generator=generator,
                output_type="pil",
            )
        encoded = []
        for image in result.images:
            buffer = io.BytesIO()
            image.save(buffer, format={"jpeg": "JPEG", "webp": "WEBP"}.get(output_format, "PNG"))
            encoded.append(buffer.getvalue())
        return encoded
