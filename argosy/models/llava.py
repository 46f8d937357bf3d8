"""Vision-language models of the LLaVA family: a CLIP or SigLIP vision tower, a two-layer
projector, and a Llama-family decoder that reads the projected patches in place of its image
tokens (`LlavaForConditionalGeneration`, as llava-hf's folders ship it).

Why LLaVA first: it is the family every peer serves the same way (vLLM, SGLang, llama.cpp's
projector files were born for it, Ollama's `llava`), its processor is a plain resize, crop and
normalise (SmolVLM's image splitting and Qwen2-VL's M-RoPE are the harder second families), and
its decoder is the Llama Argosy already runs: the paged KV cache, batching, the invariant
kernels and the compiled decode step serve it unchanged. Only its prompt's image tokens differ:
each image is one token repeated once per patch (the processor's expansion), whose embedding
rows the runner replaces with the image's projected features (AttentionMetadata.embeds).

A folder is read as its decoder (`vlm_text_config`: the text config, with the rest under
`argosy_vision`) plus this module's VisionEncoder, which runs in float32, eagerly, once per
image. Its tower is transformers' CLIPVisionModel / SiglipVisionModel on the folder's own
weights (an encoder run once per image gains nothing from the decode path's kernels).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from argosy.errors import ModelLoadError

CACHED_IMAGES = 64  # features kept per model (a CLIP-L image: 576 x 4,096 floats, 9 MB)
VISION_KEY = "argosy_vision"  # a decoder config's VLM part (vlm_text_config)
VLM_ARCHITECTURES = {"LlavaForConditionalGeneration"}
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def vlm_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A VLM folder's config as its decoder's (what the rest of the loader reads), with the
    vision part kept under VISION_KEY; any other config as it is."""
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in VLM_ARCHITECTURES:
        return config
    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise ModelLoadError(
            f"a LLaVA model with a {model_type!r} decoder is not supported (llama, mistral, qwen2)"
        )
    text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
    text[VISION_KEY] = {key: value for key, value in config.items() if key != "text_config"}
    return text


def decoder_weight_name(name: str) -> str | None:
    """A VLM checkpoint's tensor name as the decoder's (None: the tower's or the projector's).
    Both layouts: llava-hf's (`language_model.model.*`) and transformers 4.52+'s
    (`model.language_model.*`)."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return None


def _vision_weight_name(name: str) -> tuple[str, str] | None:
    """("tower" | "projector", the name in that module) of a VLM checkpoint's tensor."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "tower", name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "projector", name.removeprefix("multi_modal_projector.")
    return None


class Projector(nn.Module):
    """The vision features into the decoder's embedding space: linear, activation, linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class VisionEncoder:
    """A VLM's images into decoder embeddings: [n, 3, H, W] pixels -> [n, patches, hidden]."""

    def __init__(self, vision: dict[str, Any], text_hidden: int, weights_dir: Path) -> None:
        from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

        config = dict(vision["vision_config"])
        kind = config.get("model_type", "clip_vision_model")
        if kind == "clip_vision_model":
            self.tower: nn.Module = CLIPVisionModel(CLIPVisionConfig(**config))
        elif kind == "siglip_vision_model":
            self.tower = SiglipVisionModel(SiglipVisionConfig(**config))
        else:
            raise ModelLoadError(f"a LLaVA vision tower of type {kind!r} is not supported (CLIP, SigLIP)")
        self.is_clip = kind == "clip_vision_model"
        self.image_token_id = int(vision.get("image_token_index", vision.get("image_token_id", -1)))
        self.feature_layer = vision.get("vision_feature_layer", -2)
        self.strategy = vision.get("vision_feature_select_strategy", "default")
        if not isinstance(self.feature_layer, int):
            raise ModelLoadError("a LLaVA model taking several vision feature layers is not supported yet")
        self.projector = Projector(
            int(config["hidden_size"]),
            text_hidden,
            vision.get("projector_hidden_act", "gelu"),
            bool(vision.get("multimodal_projector_bias", True)),
        )
        self.image_size = int(config.get("image_size", 224))
        patches = (self.image_size // int(config.get("patch_size", 14))) ** 2
        # CLIP's class token comes first; the default strategy drops it (SigLIP has none)
        self.num_image_tokens = patches + (1 if self.is_clip and self.strategy == "full" else 0)
        self._load(weights_dir)
        self.tower.float().eval()
        self.projector.float().eval()
        self.processor = ImageProcessor(weights_dir, self.image_size)
        # features of the images seen last, by content digest: an image sent again (the next
        # turn of a conversation) is not encoded again
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.num_encoded = 0  # images through the tower
        self.num_cache_hits = 0  # images whose features were here already

    def features(self, images: list[Any]) -> list[torch.Tensor]:
        """Each image's [num_image_tokens, hidden] features (`images`: objects with `digest`
        and `open()`, chat/images.py's ImagePart); any thread."""
        with self._lock:
            missing = list({im.digest: im for im in images if im.digest not in self._cache}.values())
            if missing:
                pixels = torch.stack([self.processor(im.open()) for im in missing])
                for im, rows in zip(missing, self.encode(pixels), strict=True):
                    self._cache[im.digest] = rows.clone()
                    while len(self._cache) > CACHED_IMAGES:
                        self._cache.popitem(last=False)
            self.num_encoded += len(missing)
            self.num_cache_hits += len(images) - len(missing)
            found = []
            for im in images:
                found.append(self._cache[im.digest])
                self._cache.move_to_end(im.digest)
            return found

    def _load(self, weights_dir: Path) -> None:
        found: dict[str, dict[str, torch.Tensor]] = {"tower": {}, "projector": {}}
        for file in sorted(Path(weights_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                    where = _vision_weight_name(name)
                    if where is not None:
                        found[where[0]][where[1]] = f.get_tensor(name).float()
        for part, module in (("tower", self.tower), ("projector", self.projector)):
            # the module's own names, with or without transformers' `vision_model.` level
            expected = {key.removeprefix("vision_model."): key for key in module.state_dict()}
            missing = sorted(set(expected) - set(found[part]))
            if missing:
                raise ModelLoadError(
                    f"the vision {part}'s weights are missing from {weights_dir}: {missing[:3]}"
                )
            module.load_state_dict({expected[k]: v for k, v in found[part].items() if k in expected})

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] float32 (the processor's output) -> [n, num_image_tokens, hidden]."""
        out = self.tower(pixel_values=pixels.float(), output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]
        if self.is_clip and self.strategy == "default":
            features = features[:, 1:]
        result: torch.Tensor = self.projector(features)
        return result


class ImageProcessor:
    """The folder's preprocessor_config.json as CLIP's / SigLIP's image processors apply it:
    RGB, resize (the shortest edge, or to a fixed size), centre crop, rescale, normalise."""

    def __init__(self, folder: Path, image_size: int) -> None:
        import json

        path = Path(folder) / "preprocessor_config.json"
        config: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        size = config.get("size", {"shortest_edge": image_size})
        self.shortest_edge = size.get("shortest_edge") if isinstance(size, dict) else int(size)
        self.size = (
            (size.get("height"), size.get("width")) if isinstance(size, dict) and "height" in size else None
        )
        crop = config.get("crop_size", {"height": image_size, "width": image_size})
        self.crop = (crop["height"], crop["width"]) if isinstance(crop, dict) else (int(crop), int(crop))
        self.do_resize = config.get("do_resize", True)
        self.do_crop = config.get("do_center_crop", self.size is None)
        self.rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 1.0
        self.mean = np.array(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), dtype=np.float32)
        self.std = np.array(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), dtype=np.float32)
        self.normalize = config.get("do_normalize", True)
        self.resample = int(config.get("resample", 3))  # PIL's BICUBIC

    def __call__(self, image: Any) -> torch.Tensor:
        """A PIL image -> [3, H, W] float32."""
        image = image.convert("RGB")
        if self.do_resize:
            if self.size is not None:
                height, width = self.size
            else:
                assert self.shortest_edge is not None
                short, long = sorted(image.size)
                other = int(self.shortest_edge * long / short)  # transformers' get_resize_output_image_size
                width, height = (
                    (self.shortest_edge, other)
                    if image.size[0] <= image.size[1]
                    else (other, self.shortest_edge)
                )
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image, dtype=np.float32)
        if self.do_crop:
            height, width = self.crop
            top = (array.shape[0] - height) // 2
            left = (array.shape[1] - width) // 2
            array = array[top : top + height, left : left + width]
        array = array * self.rescale
        if self.normalize:
            array = (array - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def load_vision(source: Any, text_hidden: int) -> VisionEncoder | None:
    """The vision encoder of a VLM's ModelSource (a decoder config with VISION_KEY); None for
    a text-only model."""
    vision = source.hf_config.get(VISION_KEY)
    return None if vision is None else VisionEncoder(vision, text_hidden, Path(source.weights_dir))


def check_images(images: list[Any], prompt: list[int], vision: VisionEncoder | None, hidden: int) -> None:
    """A request's image placements fit its prompt: inside it, on the model's image tokens,
    with features of the decoder's width, in order and apart (an engine caller's bug, not a
    client's: the core builds them)."""
    if not images:
        return
    if vision is None:
        raise ModelLoadError("images were given to a model without a vision encoder")
    last = 0
    for image in images:
        if image.start < last or image.stop > len(prompt) or image.embeds.shape[-1] != hidden:
            raise ValueError(f"an image's features do not fit the prompt at {image.start}..{image.stop}")
        if any(prompt[j] != vision.image_token_id for j in range(image.start, image.stop)):
            raise ValueError(f"the prompt's positions {image.start}..{image.stop} are not all image tokens")
        last = image.stop
