"""OpenAI `POST /v1/images/generations` over an image model (argosy/images/service.py), and
`POST /v1/images/edits`, refused.

Body: `prompt` (1..MAX_PROMPT_CHARS), `model`, `n` (1..10), `size` (`WxH`, each a multiple of
8 from 64 to 1024, or `auto`: the model's native size), `response_format` (`b64_json`, the
default here: nothing is hosted, so `url` is a 400), `output_format` (`png` default, `jpeg`,
`webp`), and Argosy's own `seed` (the same seed gives the same pixels; without one a seed is
drawn and sent back in x-argosy-seed), `steps` (denoising steps, default 20),
`guidance_scale` (default 7.5) and `negative_prompt`. `quality`, `style`, `background`,
`moderation`, `output_compression`, `user` and unknown fields are accepted and named in
x-argosy-degraded. With no image model configured the route is a 400 naming the missing
kind (the registry's "serves no image model").
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import WireModel, degraded_headers, named_unknown
from argosy.errors import InvalidRequestError
from argosy.images.service import ImageRequest, ImageService

router = APIRouter()

MAX_PROMPT_CHARS = 4000
MIN_SIDE, MAX_SIDE = 64, 1024
SEED_HEADER = "x-argosy-seed"
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_NOT_HONOURED = ("quality", "style", "background", "moderation", "output_compression", "user")


class ImageGenerationRequest(WireModel):
    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1, le=10)
    size: str = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    steps: int = Field(20, ge=1, le=150)
    guidance_scale: float = Field(7.5, ge=0.0, le=50.0)
    negative_prompt: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    user: str | None = None

    def check(self) -> None:
        if not self.prompt.strip():
            raise InvalidRequestError("'prompt' must describe the image.", param="prompt")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"'prompt' is {len(self.prompt)} characters; at most {MAX_PROMPT_CHARS}.", param="prompt"
            )
        if self.response_format == "url":
            raise InvalidRequestError(
                "response_format 'url' needs images hosted somewhere; this server returns them inline: "
                "use 'b64_json'.",
                param="response_format",
            )
        self.dimensions(512)

    def dimensions(self, native: int) -> tuple[int, int]:
        if self.size == "auto":
            return native, native
        match = _SIZE.match(self.size)
        if match is None:
            raise InvalidRequestError(
                f"'size' must be 'WIDTHxHEIGHT' or 'auto', got {self.size!r}.", param="size"
            )
        width, height = int(match.group(1)), int(match.group(2))
        for side in (width, height):
            if not MIN_SIDE <= side <= MAX_SIDE or side % 8:
                raise InvalidRequestError(
                    f"'size' sides must be multiples of 8 from {MIN_SIDE} to {MAX_SIDE}, got {self.size!r}.",
                    param="size",
                )
        return width, height

    def degraded(self) -> list[str]:
        return [name for name in _NOT_HONOURED if getattr(self, name) is not None] + named_unknown(
            self.model_extra or {}
        )


class ImagesRoute(ModelRoute[ImageGenerationRequest]):
    route = "POST /v1/images/generations"
    kind = "image"
    body_type = ImageGenerationRequest

    async def serve(self, body: ImageGenerationRequest, service: ImageService, call: RouteCall) -> Response:
        width, height = body.dimensions(service.default_size)
        seed = body.seed if body.seed is not None else service.draw_seed()
        request = ImageRequest(
            prompt=body.prompt,
            n=body.n,
            width=width,
            height=height,
            seed=seed,
            steps=body.steps,
            guidance_scale=body.guidance_scale,
            negative_prompt=body.negative_prompt,
        )
        images = await service.generate(request, body.output_format)
        payload: dict[str, Any] = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(image).decode("ascii")} for image in images],
            "output_format": body.output_format,
            "size": f"{width}x{height}",
        }
        headers = {SEED_HEADER: str(seed), **degraded_headers(body.degraded())}
        return JSONResponse(payload, headers=headers)


@router.post("/v1/images/generations")
@takes(ImageGenerationRequest)
async def create_images(request: Request) -> Response:
    return await run_route(request, ImagesRoute())


@router.post("/v1/images/edits")
async def edit_images(request: Request) -> Response:
    raise InvalidRequestError(
        "Image edits are not supported: the image models served here generate from a prompt; none "
        "edits or inpaints an image.",
        param="image",
        code="unsupported",
    )
