"""Random-weight models of real shapes for the GPU check (bench/gpu_check.sh, tests/gpu/): the
SmolLM2-135M GGUF cannot travel to the GPU machine (64 MiB of files at most), so a model of its
exact shapes (and one of Llama 3.2 1B's) is built there, as a Hugging Face folder Argosy and
transformers both load: the same weights, the same dtype.

    python bench/gpu_models.py DIR [--shapes smollm2|1b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    # SmolLM2-135M-Instruct's config.json (the numbers that shape compute)
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Llama 3.2 1B's
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


def build(folder: Path, shapes: str = "smollm2", seed: int = 0) -> Path:
    """Write the folder (config.json, model.safetensors in bfloat16, a word-level tokenizer);
    kept if it is already there with the same shapes."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = folder / "argosy-shapes.json"
    if marker.exists() and json.loads(marker.read_text()) == {"shapes": shapes, "seed": seed}:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**SHAPES[shapes], bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # larger than the default init, so the logits are not near-flat
            for name, param in model.named_parameters():
                param.normal_(0.0, 0.05)
                if name.endswith("norm.weight"):
                    param.add_(1.0)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    marker.write_text(json.dumps({"shapes": shapes, "seed": seed}))
    return folder


def write_q4_blocks(folder: Path) -> dict[str, torch.Tensor]:
    """Quantize every projection of the folder's model to Q4_1 blocks (per 32 weights along K:
    m = min, d = (max - min) / 15 in float16, code = round((w - m) / d)) and write them as
    Argosy's int4 file (what a GGUF's Q4 blocks convert to); returns each weight's dequantized
    values, for a reference on the same numbers."""
    from safetensors.torch import load_file, save_file

    from argosy.models.gguf_quant import INT4_FILE

    weights = load_file(str(folder / "model.safetensors"))
    blocks: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not any(
            f".{p}." in name
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        ):
            continue
        n, k = w.shape
        groups = w.float().view(n, k // 32, 32)
        low = groups.amin(-1)
        d = ((groups.amax(-1) - low) / 15).half().float().clamp(min=1e-8)
        m = low.half().float()
        codes = torch.round((groups - m[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
        blocks[f"{name}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        blocks[f"{name}.d"], blocks[f"{name}.m"] = d.contiguous(), m.contiguous()
        values = codes.view(n, k // 32, 32).float() * d[..., None] + m[..., None]
        dequantized[name] = values.view(n, k)
    save_file(blocks, str(folder / INT4_FILE))
    return dequantized


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--q4", action="store_true", help="also write Q4_1 blocks of its projections")
    args = parser.parse_args()
    print(build(args.folder, args.shapes))
    if args.q4:
        write_q4_blocks(args.folder)


if __name__ == "__main__":
    main()
