"""--numerics invariant on the real SmolLM2 (int4, eager steps): a request's tokens and
logprobs (top 5 included, compared as floats, so bit for bit) are the same solo, in batches
with random neighbours, decoding beside another prompt's chunked prefill, with the prompt
prefilled in chunks of 1, 7, 16, 64 or 512 tokens, and after a prefix-cache hit; a seeded sampled
request too. The compiled decode step is held to the same by bench/batch_flips.py
(--numerics invariant: 0 of 100 prompts differ)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from argosy.config import EngineConfig
from argosy.engine.llm_engine import LLMEngine
from argosy.ops.native import load_native_ops
from argosy.ops.quantized_linear import CodesEmbedding
from argosy.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not load_native_ops(), reason="the invariant kernels need a C++ compiler"),
]

PROMPT = (
    "Write a short story about the ocean and the moon, with a robot who loves bread and music in "
    "the rain at night, in three paragraphs."
)
WORDS = ["rain", "bread", "a city", "mountains", "music", "the sea", "robots", "night"]
Result = tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]
_ids = itertools.count()


def engine(**overrides: object) -> LLMEngine:
    config = {"model": "smollm2", "numerics": "invariant", "compile": "off", "kv_cache_memory": 1 << 27}
    return LLMEngine(EngineConfig(**(config | overrides)))  # type: ignore[arg-type]


def params(seed: int | None = None) -> SamplingParams:
    temperature = 0.0 if seed is None else 0.9
    return SamplingParams(
        max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True, logprobs=5, detokenize=False
    )


def generate(llm: LLMEngine, prompts: list[list[int]], seed: int | None = None) -> list[Result]:
    """Every prompt at once; the first one's result (and the others')."""
    names = [f"r{next(_ids)}" for _ in prompts]
    for name, prompt in zip(names, prompts, strict=True):
        llm.add_request(name, prompt, params(seed))
    results: dict[str, Result] = {name: ([], []) for name in names}
    while llm.has_unfinished():
        for out in llm.step():
            tokens, logprobs = results[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend((lp.logprob, lp.top) for lp in out.new_logprobs or [])
    return [results[name] for name in names]


@pytest.fixture(scope="module")
def llm() -> LLMEngine:
    return engine()


@pytest.fixture(scope="module")
def prompt(llm: LLMEngine) -> list[int]:
    return llm.encode(PROMPT)


@pytest.fixture(scope="module")
def solo(llm: LLMEngine, prompt: list[int]) -> Result:
    return generate(llm, [prompt])[0]


def neighbours(llm: LLMEngine, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        llm.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 60)))) for _ in range(count)
    ]


def test_a_prefix_cache_hit_gives_the_same_tokens_and_logprobs(
    llm: LLMEngine, prompt: list[int], solo: Result
) -> None:
    before = llm.stats().prefix_cache_hits
    assert generate(llm, [prompt])[0] == solo
    assert llm.stats().prefix_cache_hits > before  # it was a hit


@pytest.mark.parametrize("size", [2, 3, 8, 16, 64])
def test_any_batch_gives_the_same_tokens_and_logprobs(
    llm: LLMEngine, prompt: list[int], solo: Result, size: int
) -> None:
    others = neighbours(llm, size - 1, seed=size)
    assert generate(llm, [prompt, *others])[0] == solo
    assert generate(llm, [*others, prompt])[-1] == solo  # its place in the batch does not matter


def test_decoding_beside_a_chunked_prefill_changes_nothing(
    llm: LLMEngine, prompt: list[int], solo: Result
) -> None:
    long = llm.encode(" ".join(["the history of the printing press"] * 300))  # > one step's budget
    llm.add_request("p", prompt, params())
    tokens: list[int] = []
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    added = False
    while llm.has_unfinished():
        for out in llm.step():
            if out.request_id == "p":
                tokens.extend(out.new_token_ids)
                logprobs.extend((lp.logprob, lp.top) for lp in out.new_logprobs or [])
        if not added:  # after the prompt's own prefill: its decode steps share the long prefill's
            llm.add_request("long", long, SamplingParams(max_tokens=2, detokenize=False))
            added = True
    assert (tokens, logprobs) == solo


@pytest.mark.parametrize(("budget", "block_size"), [(1, 1), (7, 4), (16, 16), (64, 16), (512, 16)])
def test_prefill_chunking_changes_nothing(
    prompt: list[int], solo: Result, budget: int, block_size: int
) -> None:
    """A step's token budget is at least a KV block: chunks of 1 and 7 tokens take smaller
    blocks (the cache's layout, which the arithmetic does not see)."""
    chunked = engine(max_num_batched_tokens=budget, block_size=block_size, enable_prefix_caching=False)
    assert generate(chunked, [prompt])[0] == solo


def test_the_last_layer_run_for_the_rows_read_alone_changes_nothing(
    llm: LLMEngine, prompt: list[int], solo: Result, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last layer attends and runs its MLP for the rows a step reads (a prefill's last row,
    a prompt-logprobs chunk's every row); every row's K/V still reaches the cache, and the rows
    read get the bits the whole layer gives them."""
    from argosy.ops.attention import CpuPagedAttention

    others = neighbours(llm, 3, seed=11)
    pruned = generate(llm, [prompt, *others])
    rows: list[tuple[int, int]] = []
    kept = CpuPagedAttention._kept

    def counting(self: CpuPagedAttention, q: torch.Tensor, *args: object) -> torch.Tensor:
        out: torch.Tensor = kept(self, q, *args)  # type: ignore[arg-type]
        rows.append((q.shape[0], out.shape[0]))
        return out

    monkeypatch.setattr(CpuPagedAttention, "_kept", counting)
    with_logprobs = dataclasses.replace(params(), prompt_logprobs=3)
    llm.add_request("plp", prompt, with_logprobs)
    pruned_prompt_logprobs = None
    while llm.has_unfinished():
        for out in llm.step():
            pruned_prompt_logprobs = out.prompt_logprobs or pruned_prompt_logprobs
    assert rows == [] and pruned_prompt_logprobs is not None  # a chunk asking them keeps every row
    llm.block_manager.reset_prefix_cache()  # a whole prefill again, not the prompt's last token alone
    assert generate(llm, [prompt])[0] == solo
    assert rows and all(n_out < n_in for n_in, n_out in rows)  # the prefill's last layer: one row
    monkeypatch.setattr(llm.runner, "_prunes_last_layer", False)
    assert generate(llm, [prompt, *others]) == pruned
    assert generate(llm, [prompt])[0] == solo
    llm.add_request("plp2", prompt, with_logprobs)
    whole_prompt_logprobs = None
    while llm.has_unfinished():
        for out in llm.step():
            whole_prompt_logprobs = out.prompt_logprobs or whole_prompt_logprobs
    assert whole_prompt_logprobs == pruned_prompt_logprobs


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(llm: LLMEngine, prompt: list[int]) -> None:
    alone = generate(llm, [prompt], seed=7)[0]
    assert generate(llm, [prompt, *neighbours(llm, 7, seed=1)], seed=7)[0] == alone
    assert generate(llm, [prompt], seed=7)[0] == alone  # a cache hit now
    assert generate(llm, [prompt], seed=8)[0] != alone


def test_the_mode_is_described(llm: LLMEngine) -> None:
    description = llm.describe()
    assert description.deterministic
    assert description.kernels.startswith("native+invariant-")
    assert "invariant kernels" in llm.weights
    # SmolLM2's tied Q8_0 table: tokens embed from the head's codes (exact float32), no bf16 copy
    assert isinstance(llm.model.embed_tokens, CodesEmbedding)
    assert llm.model.embed_tokens(torch.tensor([0, 1])).dtype == torch.float32


def test_batch_invariant_is_accepted_and_needs_no_solo_steps(llm: LLMEngine, prompt: list[int]) -> None:
    """Every request of an invariant engine already is: the flag no longer makes the scheduler
    run it alone (its steps would cost the others throughput for nothing)."""
    solo = dataclasses.replace(params(), batch_invariant=True)
    llm.add_request("flagged", prompt, solo)
    assert llm.sequences["flagged"].params.batch_invariant is False
    llm.abort("flagged")


def test_the_compiled_decode_step_gives_the_eager_step_bits() -> None:
    """A token decoded by the compiled graph must equal the same token decoded eagerly (a
    prefix-cache hit's first token comes from one, a miss's from the other). The RMSNorm's
    float64 mean is what makes them agree (in float32 the summation orders differed in the
    last bit, amplified to 0.6 in the logits)."""
    import torch

    from argosy.runner.compiled import CompiledDecoder

    # the server's KV pool: the same graphs as the default-mode e2e server's (inductor's cache)
    llm = engine(compile="wait", kv_cache_memory=EngineConfig().kv_cache_memory)
    compiled = llm.runner.compiled
    assert compiled is not None
    captured: list[tuple[torch.Tensor, ...]] = []
    call = CompiledDecoder.__call__

    def capture(self: CompiledDecoder, *args: torch.Tensor) -> torch.Tensor:
        captured.append(tuple(a.clone() for a in args))
        return call(self, *args)

    CompiledDecoder.__call__ = capture  # type: ignore[method-assign]
    try:
        prompts = [llm.encode(PROMPT), *(llm.encode(f"Tell me about {w}.") for w in WORDS[:2])]
        generate(llm, prompts[:1])
        generate(llm, prompts)
    finally:
        CompiledDecoder.__call__ = call  # type: ignore[method-assign]
    rows = {args[0].shape[0] for args in captured}
    assert 1 in rows and max(rows) > 1
    with torch.inference_mode():
        for args in captured[:: max(1, len(captured) // 6)]:
            k_all, v_all = args[6].clone(), args[7].clone()
            eager = compiled.graph(*args)
            args[6].copy_(k_all)
            args[7].copy_(v_all)
            assert torch.equal(compiled(*args).view(torch.int32), eager.view(torch.int32)), args[0].shape


def test_int8_weights_run_the_invariant_kernels_too(prompt: list[int]) -> None:
    """--quantization int8 (every projection and the head GGUF-Q8_0-style) is invariant as well:
    its fp32 stream never meets a float layer."""
    int8 = engine(quantization="int8")
    assert int8.describe().deterministic
    alone = generate(int8, [prompt])[0]
    assert generate(int8, [prompt, *neighbours(int8, 3, seed=5)])[0] == alone


def test_gemma3_decodes_the_same_tokens_compiled_and_eager() -> None:
    """Gemma 3's layers (sliding-window and global attention, q/k norms, GeGLU) in the compiled
    decode graph give the eager steps' tokens and logprobs bit for bit, alone and beside other
    requests, past the 512-token window too: the graph runs the model's own `forward_with`, its
    gelu is aten's (an opaque op), and a window's mask is narrowed as the eager step's."""
    from argosy.models import loader

    try:
        loader.resolve_model("gemma3")
    except Exception as exc:  # noqa: BLE001 - the package is a test dependency, but say why
        pytest.skip(f"gemma3 is not available: {exc}")
    gemma = engine(model="gemma3")
    prompts = [
        gemma.encode(" ".join(["the ocean and the moon, and a robot who loves bread"] * 60)),  # > 512
        gemma.encode("Tell me about rain."),
        gemma.encode("def fibonacci(n):"),
    ]
    eager = generate(gemma, prompts)
    assert gemma.runner.compile_decode([1, 2])  # the one-row graph and the many-row one
    before = gemma.runner.num_compiled_steps
    assert generate(gemma, prompts) == eager
    assert generate(gemma, prompts[:1]) == eager[:1]
    assert gemma.runner.num_compiled_steps > before
