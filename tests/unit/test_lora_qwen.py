"""A LoRA adapter on the real Qwen2.5-Coder-0.5B (its Q4_K_M file, Argosy's default numerics):
an adapter made by peft (rank 8, q/k/v/o, random non-zero B) on the file's weights dequantized
to float32; Argosy's first 32 greedy tokens with it equal transformers + peft's, and their
logprobs stay within the default mode's distance from float32 (bench/quality.py: mean
|Δ logprob| ~0.015 on this model without an adapter)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from tests.unit.test_engine import greedy, run_one

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@torch.inference_mode()
def test_greedy_tokens_with_an_adapter_equal_transformers_with_peft(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from argosy.models.loader import resolve_model
    from tests.hf_reference import hf_model

    source = resolve_model(MODEL)
    ids: list[int] = source.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    base = hf_model(source)
    torch.manual_seed(8)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    reference = get_peft_model(base, config, autocast_adapter_dtype=False).eval()
    for name, param in reference.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (no change): a trained adapter's is not
            param.normal_(0.0, 0.02)
    reference.save_pretrained(tmp_path / "adapter")
    out = reference.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), -1)[torch.arange(32), torch.tensor(tokens)]
    with reference.disable_adapter():
        base_tokens = reference.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, min_new_tokens=32, do_sample=False,
        )[0, len(ids) :].tolist()  # fmt: skip
    del reference, base

    engine = LLMEngine(
        EngineConfig(model=MODEL, compile="off", loras=(("fib", str(tmp_path / "adapter")),)), source=source
    )
    assert engine.invariant  # the default numerics: the file's own codes, invariant kernels
    got = run_one(engine, ids, greedy(32, lora="fib", logprobs=0))
    assert got.token_ids == tokens
    assert tokens != base_tokens  # the adapter changes the answer
    ours = torch.tensor([lp.logprob for lp in got.logprobs])
    assert (ours - logprobs).abs().mean() < 0.05, (ours - logprobs).abs()
