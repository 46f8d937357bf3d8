"""Image generation through the official openai client, on a tiny Stable Diffusion pipeline
built here with random weights (no diffusion model ships on PyPI): a UNet of block widths
(32, 64), a small AutoencoderKL and CLIP text encoder, DDIM, and a byte-level CLIP tokenizer
written by the test. It proves loading, the parameters (`n`, `size`, `response_format`,
`seed`), and real PNG output; the same seed gives the same pixels.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.server import ServerProcess, models_server

pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.e2e


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies hold)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tiny_pipeline(folder: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    )
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
    )
    # byte-level BPE with no merges: every character a token, "</w>" marking a word's end
    symbols = byte_symbols()
    vocab = {token: i for i, token in enumerate([*symbols, *(s + "</w>" for s in symbols)])}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    words = folder / "clip-tokenizer"
    words.mkdir(parents=True)
    (words / "vocab.json").write_text(json.dumps(vocab))
    (words / "merges.txt").write_text("#version: 0.2\n")
    (words / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))  # CLIP's context
    tokenizer = CLIPTokenizer.from_pretrained(
        words
    )  # keywords to the constructor are ignored (transformers 5)
    assert len(tokenizer) == len(vocab) and tokenizer.model_max_length == 77
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            pad_token_id=vocab["<|endoftext|>"],
            vocab_size=len(vocab),
        )
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(folder / "tiny-sd")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("images")
    build_tiny_pipeline(directory)
    toml = f'[[model]]\nid = "tiny-sd"\nsource = "{directory / "tiny-sd"}"\naliases = ["dall-e-2"]\n'
    with models_server(directory, toml) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def pixels(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image)


def test_generate_pngs_with_n_size_and_seed(client: openai.OpenAI) -> None:
    first = client.images.generate(
        model="dall-e-2",
        prompt="a red square",
        n=2,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 42, "steps": 4},
    )
    images = [pixels(d.b64_json or "") for d in first.data]
    assert len(images) == 2 and all(i.shape == (64, 64, 3) for i in images)
    assert not np.array_equal(images[0], images[1])  # two draws of one generator
    assert all(i.std() > 0 for i in images)
    again = client.images.generate(
        model="tiny-sd", prompt="a red square", n=2, size="64x64", extra_body={"seed": 42, "steps": 4}
    )
    assert all(np.array_equal(a, pixels(b.b64_json or "")) for a, b in zip(images, again.data, strict=True))
    other = client.images.generate(
        model="tiny-sd", prompt="a red square", size="64x64", extra_body={"seed": 7, "steps": 4}
    )
    assert not np.array_equal(images[0], pixels(other.data[0].b64_json or ""))
    wide = client.images.generate(model="tiny-sd", prompt="a field", size="128x64", extra_body={"steps": 2})
    assert pixels(wide.data[0].b64_json or "").shape == (64, 128, 3)


def test_seed_header_native_size_and_degraded_fields(server: ServerProcess) -> None:
    body = {"model": "tiny-sd", "prompt": "a cat", "steps": 2, "quality": "hd", "style": "vivid"}
    response = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert int(response.headers["x-argosy-seed"]) >= 0
    assert response.headers["x-argosy-degraded"] == "quality, style"
    assert response.json()["size"] == "64x64"  # auto: the pipeline's native size (32 latents x 2)
    models = {m["id"]: m["capabilities"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    assert models["tiny-sd"]["kind"] == "image" and models["tiny-sd"]["tasks"] == ["generate"]


def test_refusals(client: openai.OpenAI, server: ServerProcess) -> None:
    cases = [
        ({"size": "100x100"}, "size"),
        ({"size": "2048x2048"}, "size"),
        ({"size": "big"}, "size"),
        ({"n": 11}, "n"),
        ({"response_format": "url"}, "response_format"),
        ({"prompt": " "}, "prompt"),
    ]
    for extra, param in cases:
        body = {"model": "tiny-sd", "prompt": "a cat"} | extra
        response = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (
            extra,
            response.text,
        )
    big = {"model": "tiny-sd", "prompt": "x" * 70_000}
    assert httpx.post(f"{server.base_url}/v1/images/generations", json=big, timeout=60).status_code == 413
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(
            model="tiny-sd", image=("a.png", b"\x89PNG" + b"\0" * 2_000_000), prompt="add a hat"
        )
    assert caught.value.body["code"] == "unsupported"  # type: ignore[index]
