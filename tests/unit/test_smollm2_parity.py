"""SmolLM2-135M-Instruct (the default model) against transformers on the same weights.

The loader converts the packaged GGUF into an HF folder (config.json + safetensors + tokenizer
files); transformers loads that same folder, so both sides run identical weights. Prompts are
rendered with the model's own chat template (transformers' renderer).
"""

from __future__ import annotations

import pytest
import torch

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import prefill_logits

loader = pytest.importorskip("argosy.models.loader")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three prime numbers, then explain why each is prime."},
    ],
]
KV_CACHE = 64 << 20
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def hf_model(smollm2_source):  # type: ignore[no-untyped-def]
    from tests.hf_reference import hf_model as reference_model

    return reference_model(smollm2_source)


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    from argosy.llm import LLM

    return LLM("smollm2", dtype="float32", quantization="none", compile="off", kv_cache_memory=KV_CACHE)


@pytest.fixture(scope="module")
def prompts(smollm2_hf_tokenizer) -> list[str]:  # type: ignore[no-untyped-def]
    return [
        smollm2_hf_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in CONVERSATIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy_64(llm, hf_model, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """transformers' greedy 64 tokens for each prompt, EOS not stopping it."""
    outputs = []
    for text in prompts:
        ids = llm.engine.encode(text)
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=EOS,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def until_eos(token_ids: list[int]) -> list[int]:
    """Greedy is deterministic: stopping at EOS gives the no-EOS output cut after its first EOS."""
    return token_ids[: token_ids.index(EOS) + 1] if EOS in token_ids else token_ids


def test_chat_prompts_tokenize_like_transformers(llm, smollm2_hf_tokenizer, prompts) -> None:  # type: ignore[no-untyped-def]
    for text in prompts:
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert llm.engine.encode(text) == smollm2_hf_tokenizer(text).input_ids


def test_greedy_64_tokens_match_transformers(llm, hf_greedy_64, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    results = llm.generate(prompts, params)
    for result, expected in zip(results, hf_greedy_64, strict=True):
        assert len(result.token_ids) == 64
        assert result.token_ids == expected
        assert result.finish_reason == "length"


def test_llm_generate_end_to_end_with_text(llm, hf_greedy_64, smollm2_hf_tokenizer, prompts) -> None:  # type: ignore[no-untyped-def]
    llm.engine.block_manager.reset_prefix_cache()  # what the tests before this one left in it
    results = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    for result, full in zip(results, hf_greedy_64, strict=True):
        expected = until_eos(full)
        assert result.token_ids == expected
        assert result.text == smollm2_hf_tokenizer.decode(expected, skip_special_tokens=True)
        if expected[-1] == EOS:
            assert (result.finish_reason, result.stop_reason) == ("stop", None)
        else:
            assert result.finish_reason == "length"
    assert "Paris" in results[0].text
    assert results[0].finish_reason == "stop"
    # the same conversation again: its chat prefix is served from the prefix cache (its 2 whole
    # blocks: the answer stopped before the third filled)
    again = llm.generate(prompts[0], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert again.num_cached_tokens == 32
    assert again.text == results[0].text


def test_logits_match_transformers_fp32(llm, hf_model, prompts) -> None:  # type: ignore[no-untyped-def]
    ids = llm.engine.encode(prompts[2])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(llm.engine, ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(prefill_logits(llm.engine, ids, split=17), expected, atol=1e-4, rtol=0)


def test_logits_match_transformers_bf16(smollm2_source, hf_model, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(
        EngineConfig(
            model="smollm2", dtype="bfloat16", quantization="none", compile="off", kv_cache_memory=8 << 20
        ),
        source=smollm2_source,
    )
    ids = engine.encode(prompts[2])
    # RoPE's frequencies stay float32 in both (module.to(bfloat16) would round transformers' too)
    frequencies = {name: buffer.clone() for name, buffer in hf_model.named_buffers() if "inv_freq" in name}
    with torch.inference_mode():
        reference = hf_model.to(torch.bfloat16)
        try:
            for name, buffer in frequencies.items():
                reference.get_submodule(name.rpartition(".")[0]).register_buffer(
                    name.rpartition(".")[2], buffer.clone(), persistent=False
                )
            expected = reference(torch.tensor([ids])).logits[0].float()
        finally:
            hf_model.to(torch.float32)
            for name, buffer in frequencies.items():
                hf_model.get_submodule(name.rpartition(".")[0]).register_buffer(
                    name.rpartition(".")[2], buffer, persistent=False
                )
    ours = prefill_logits(engine, ids)
    # same dtype, same rounding points: far closer than bf16 is to fp32 (about 1.3 here)
    assert float((ours - expected).abs().max()) < 0.25
    # the top choice agrees wherever transformers' own margin is clear
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert clear.sum() > len(ids) // 2
    assert torch.equal(ours.argmax(-1)[clear], expected.argmax(-1)[clear])
