"""A LLaVA vision-language model (argosy/models/llava.py) on a tiny random one built by
transformers (a CLIP tower, the projector, a Llama decoder): Argosy's greedy tokens for a prompt
with one and with two images equal transformers' `generate` on the same weights in float32,
logprobs within 1e-4; the image processor gives CLIPImageProcessor's pixels; a request with an
image beside text-only neighbours gets its solo tokens (the invariant mode); the prefix cache
tells two images apart behind the same tokens."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.engine.sequence import ImagePlacement
from argosy.models.llava import ImageProcessor, vlm_text_config
from argosy.models.source import ModelSource
from tests.unit.conftest import TINY_VOCAB
from tests.unit.test_engine import greedy, run, run_one
from tests.unit.test_lora import reference_greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IMAGE_TOKEN = 299
PATCHES = 16  # a 32-pixel image in 8-pixel patches, the class token dropped


@dataclass
class TinyLlava:
    reference: torch.nn.Module
    processor: object  # transformers' CLIPImageProcessor
    source: ModelSource
    folder: Path

    def engine(self, **options: object) -> LLMEngine:
        values: dict[str, object] = dict(
            model="tiny-llava", dtype="float32", kv_cache_memory=1 << 22, block_size=16, compile="off"
        )
        values.update(options)
        return LLMEngine(EngineConfig(**values), source=self.source)  # type: ignore[arg-type]


def build_tiny_llava(folder: Path, tower: str = "clip") -> TinyLlava:
    """A seeded tiny LLaVA: a CLIP tower (its class token dropped: the default strategy) or a
    SigLIP one (no class token: the full strategy), 16 patches of 8 pixels either way."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32
    )
    vision = (
        CLIPVisionConfig(patch_size=8, **shape)
        if tower == "clip"
        else SiglipVisionConfig(patch_size=8, **shape)
    )
    text = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    strategy = "default" if tower == "clip" else "full"
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(5)
    model = LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2 if "vision_tower" not in name else 0.05)
            if name.endswith("norm.weight") or "layernorm.weight" in name or "layer_norm" in name:
                param.add_(1.0)
    model.save_pretrained(folder)
    if tower == "clip":
        processor: object = CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    else:
        processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(folder)  # type: ignore[attr-defined]
    source = ModelSource(
        name="tiny-llava",
        architecture="LlamaForCausalLM",
        hf_config=vlm_text_config(json.loads((folder / "config.json").read_text())),
        weights_dir=folder,
        tokenizer=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")),
        chat_template=None,
        bos_token=None,
        eos_token=None,
        bos_token_id=None,
        eos_token_ids=[],
        add_bos_token=False,
    )
    return TinyLlava(model, processor, source, folder)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def images(seed: int, count: int) -> list[object]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(40, 50), (64, 48), (33, 33)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:count]]


def prompt_with(count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 290, (5 * (count + 1),), generator=g).tolist()
    ids: list[int] = []
    for k in range(count + 1):
        ids += text[5 * k : 5 * (k + 1)]
        if k < count:
            ids += [IMAGE_TOKEN] * PATCHES
    return ids


def placements(
    engine: LLMEngine, ids: list[int], pictures: list[object], size: int = 32
) -> list[ImagePlacement]:
    assert engine.vision is not None
    processor = ImageProcessor(engine.source.weights_dir, size)
    pixels = torch.stack([processor(p) for p in pictures])
    embeds = engine.vision.encode(pixels)
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN and (i == 0 or ids[i - 1] != IMAGE_TOKEN)]
    return [
        ImagePlacement(start, embeds[k], hashlib.sha256(pictures[k].tobytes()).digest())  # type: ignore[attr-defined]
        for k, start in enumerate(starts)
    ]


@torch.inference_mode()
def reference(
    tiny: TinyLlava, ids: list[int], pictures: list[object], n: int
) -> tuple[list[int], torch.Tensor]:
    pixels = tiny.processor(pictures, return_tensors="pt")["pixel_values"]  # type: ignore[operator]
    return reference_greedy(tiny.reference, ids, n, pixel_values=pixels)


def test_the_image_processor_gives_clip_processors_pixels(tiny_llava: TinyLlava) -> None:
    pictures = images(1, 3)
    theirs = tiny_llava.processor(pictures, return_tensors="pt")["pixel_values"]  # type: ignore[operator]
    ours = torch.stack([ImageProcessor(tiny_llava.folder, 32)(p) for p in pictures])
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("count", [1, 2])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_llava: TinyLlava, count: int) -> None:
    engine = tiny_llava.engine()
    ids, pictures = prompt_with(count, 3 + count), images(count, count)
    tokens, logprobs = reference(tiny_llava, ids, pictures, 16)
    engine.add_request("v", ids, greedy(16, logprobs=0), images=placements(engine, ids, pictures))
    out = run(engine, {})["v"]
    assert out.token_ids == tokens
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    theirs = logprobs[torch.arange(16), torch.tensor(tokens)]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # the image matters: the same tokens without it (its token's own embedding) answer otherwise
    assert run_one(engine, ids, greedy(16), "blind").token_ids != tokens


def test_an_image_request_beside_text_only_neighbours_gets_its_solo_tokens(tiny_llava: TinyLlava) -> None:
    engine = tiny_llava.engine(dtype="bfloat16", quantization="int8", numerics="invariant")
    ids, pictures = prompt_with(2, 9), images(4, 2)
    placed = placements(engine, ids, pictures)
    engine.add_request("alone", ids, greedy(12), images=placed)
    alone = run(engine, {})["alone"].token_ids
    others = {f"t{k}": (prompt_with(0, 20 + k) * 4, greedy(12)) for k in range(3)}
    for rid, (text_ids, params) in others.items():
        engine.add_request(rid, text_ids, params)
    engine.add_request("with", ids, greedy(12), images=placed)
    together = run(engine, {})
    assert together["with"].token_ids == alone


def test_the_prefix_cache_tells_two_images_apart(tiny_llava: TinyLlava) -> None:
    engine = tiny_llava.engine()
    ids = prompt_with(1, 2) + prompt_with(0, 6) * 4  # the image in the first two blocks
    first, second = images(7, 1), images(8, 1)
    engine.add_request("a", ids, greedy(8), images=placements(engine, ids, first))
    a = run(engine, {})["a"]
    engine.add_request("b", ids, greedy(8), images=placements(engine, ids, second))
    b = run(engine, {})["b"]
    assert b.num_cached_tokens == 0 and b.token_ids != a.token_ids
    engine.add_request("a2", ids, greedy(8), images=placements(engine, ids, first))
    again = run(engine, {})["a2"]
    assert again.num_cached_tokens > 0 and again.token_ids == a.token_ids


def test_a_siglip_tower_gives_transformers_tokens_too(tmp_path: Path) -> None:
    tiny = build_tiny_llava(tmp_path, tower="siglip")
    engine = tiny.engine()
    assert engine.vision is not None and engine.vision.num_image_tokens == PATCHES
    ids, pictures = prompt_with(1, 12), images(12, 1)
    pixels = tiny.processor(pictures, return_tensors="pt")["pixel_values"]  # type: ignore[operator]
    ours = torch.stack([ImageProcessor(tiny.folder, 32)(p) for p in pictures])
    assert torch.allclose(ours, pixels, atol=1e-5)
    tokens, _ = reference(tiny, ids, pictures, 12)
    engine.add_request("s", ids, greedy(12), images=placements(engine, ids, pictures))
    assert run(engine, {})["s"].token_ids == tokens


def test_bfloat16_stays_within_its_tolerance_of_transformers_bfloat16(tiny_llava: TinyLlava) -> None:
    """bf16 weights and activations (the fast mode) against transformers in bf16 on the same
    weights: greedy tokens equal while both agree on the first, its logprob within bf16's
    rounding (2^-8 relative, through the tower and two decoder layers)."""
    import copy
    import dataclasses

    bf16 = dataclasses.replace(tiny_llava, reference=copy.deepcopy(tiny_llava.reference).to(torch.bfloat16))
    engine = tiny_llava.engine(dtype="bfloat16")
    ids, pictures = prompt_with(1, 4), images(1, 1)
    tokens, logprobs = reference(bf16, ids, pictures, 4)
    engine.add_request("b", ids, greedy(4, logprobs=0), images=placements(engine, ids, pictures))
    out = run(engine, {})["b"]
    assert out.token_ids[0] == tokens[0]
    assert abs(out.logprobs[0].logprob - float(logprobs[0, tokens[0]])) < 0.1
