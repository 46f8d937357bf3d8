"""The invariant attention over int8 KV caches (csrc/iq_attention.cpp, --kv-cache-dtype int8): a
row's K/V is written as llama.cpp's q8_0 (codes and a float16 scale per 32 dims, the rule in the
kernel's header, checked here against a Python statement of it); every path gives the scalar
statement's bits whatever rows share the call; a value reads back as code * scale exactly; and
the result stays close to the float16 cache's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from argosy.ops.native import load_invariant_ops, load_native_ops
from argosy.sampling_params import SamplingParams
from tests.unit.test_invariant_kernels import BLOCK, bits, paged_case

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="no C++ compiler for the native kernels")


@pytest.fixture(autouse=True)
def built() -> None:
    assert load_invariant_ops(), "the invariant kernels did not build (see the log)"


@pytest.fixture
def paths() -> Iterator[list[str]]:
    yield list(torch.ops.argosy_iq.paths())
    torch.ops.argosy_iq.set_path("auto")


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float32 -> [..., D + D / 16] int8: the kernel's rule, stated in torch."""
    groups = x.float().unflatten(-1, (-1, 32))
    d = (groups.abs().amax(-1, keepdim=True) / 127).half()
    df = d.float()
    codes = torch.where(df > 0, torch.round(groups / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    scale_bytes = d.squeeze(-1).contiguous().view(torch.int16).view(torch.int8)
    return torch.cat([codes.to(torch.int8).flatten(-2), scale_bytes], dim=-1)


def dequantized(rows: torch.Tensor, dim: int) -> torch.Tensor:
    codes = rows[..., :dim].float().unflatten(-1, (-1, 32))
    scales = rows[..., dim:].contiguous().view(torch.float16).float()
    return (codes * scales[..., None]).flatten(-2)


def int8_case(case):  # type: ignore[no-untyped-def]
    """An fp16-cache case (paged_case) with its caches as int8 rows and k, v as float32."""
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    return q, k.float(), v.float(), q8_rows(k_cache.float()), q8_rows(v_cache.float()), slots, block_ids, mask


def attend8(case, rows: slice | torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    torch.ops.argosy_iq.write_kv(
        k, v, k_cache, v_cache, slots
    )  # every row's K/V, as a whole step writes them
    if rows is not None:
        max_blocks = block_ids.numel() // q.shape[0]
        q, k, v, slots, mask = q[rows], k[rows], v[rows], slots[rows], mask[rows]
        block_ids = block_ids.view(-1, max_blocks)[rows].reshape(-1)
    return torch.ops.argosy_iq.attention(q, k, v, k_cache, v_cache, slots, block_ids, mask, BLOCK)


def assert_same_bits_everywhere(paths: list[str], case) -> torch.Tensor:  # type: ignore[no-untyped-def]
    torch.ops.argosy_iq.set_path("scalar")
    reference = attend8(case)
    count = reference.shape[0]
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(attend8(case)), bits(reference)), path
        alone = torch.cat([attend8(case, slice(i, i + 1)) for i in range(count)])
        assert torch.equal(bits(alone), bits(reference)), path
        backwards = torch.arange(count - 1, -1, -1)
        assert torch.equal(bits(attend8(case, backwards)), bits(reference[backwards])), path
    return reference


def test_write_kv_is_q8_0_per_32_dims() -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 64, generator=gen) * torch.tensor([0.01, 30.0]).view(1, 2, 1)
    v = torch.randn(5, 2, 64, generator=gen)
    k[0, 0] = 0.0  # an all-zero row: codes and scales 0
    k[1, 1, :32] = torch.tensor([0.5, -0.5, 1.5] * 10 + [127.0, -127.0])  # ties, and the group's max
    k_cache = torch.zeros(16, 2, 68, dtype=torch.int8)
    v_cache = torch.zeros(16, 2, 68, dtype=torch.int8)
    slots = torch.tensor([3, 0, 15, 7, 8])
    torch.ops.argosy_iq.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], q8_rows(k))
    assert torch.equal(v_cache[slots], q8_rows(v))
    assert (k_cache[3, 0] == 0).all()
    assert torch.allclose(dequantized(k_cache[slots], 64), k, rtol=0, atol=float(k.abs().max()) / 127)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_rows_give_the_scalar_bits_on_every_path(paths: list[str], dim: int, group: int) -> None:
    lengths = [1, 15, 16, 17, 33, 63, 64, 65, 129, 0, *range(40, 300, 23)]
    case = int8_case(
        paged_case(dim + group, [max(n, 1) for n in lengths], list(enumerate(lengths)), dim, 4 * group, 4)
    )
    assert_same_bits_everywhere(paths, case)


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
def test_prefill_rows_give_the_scalar_bits_on_every_path(paths: list[str], dim: int) -> None:
    rows = [(0, n) for n in range(20, 92)] + [(1, 45), (2, 0)]
    case = int8_case(paged_case(3 * dim, [91, 45, 1], rows, dim, 6, 2))
    assert_same_bits_everywhere(paths, case)


def test_a_value_reads_back_as_code_times_scale_exactly(paths: list[str]) -> None:
    """One position per row: the output is that position's dequantized V, on every path."""
    rows = [(s, 1) for s in range(12)]
    case = int8_case(paged_case(5, [1] * len(rows), rows, 64, 8, 4))
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    want = dequantized(q8_rows(v), 64).repeat_interleave(2, dim=1).reshape(len(rows), -1)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(attend8(case), want), path


def test_int8_attention_stays_close_to_the_float16_caches() -> None:
    rows = [(0, n) for n in range(100, 140)] + [(1, 300)]
    case = paged_case(9, [139, 300], rows, 64, 8, 2)
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    k_all, v_all = k_cache.clone(), v_cache.clone()
    k_all[slots], v_all[slots] = k, v
    fp16 = torch.ops.argosy_iq.attention(q, k, v, k_all, v_all, slots, block_ids, mask, BLOCK)
    int8 = attend8(int8_case(case))
    assert (int8 - fp16).abs().max() < 0.05 * fp16.abs().max()


def test_int8_caches_refuse_float16_rows_and_a_wrong_width() -> None:
    case = int8_case(paged_case(2, [20], [(0, 20)], 64, 4, 2))
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    with pytest.raises(RuntimeError, match="float32 k, v and int8 caches"):
        torch.ops.argosy_iq.attention(q, k.half(), v.half(), k_cache, v_cache, slots, block_ids, mask, BLOCK)
    with pytest.raises(RuntimeError, match="cache shape"):
        torch.ops.argosy_iq.attention(
            q,
            k,
            v,
            k_cache[..., :64].contiguous(),
            v_cache[..., :64].contiguous(),
            slots,
            block_ids,
            mask,
            BLOCK,
        )


# -- the engine over an int8 cache ----------------------------------------------------------------


@pytest.fixture
def tiny_qwen3(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.unit.conftest import _get

    return _get(tiny_models, "qwen3", tmp_path_factory)  # head dim 32: int8 rows of 32 dims


def invariant_engine(model, kv: str = "auto", **options):  # type: ignore[no-untyped-def]
    values = dict(dtype="bfloat16", quantization="int8", numerics="invariant", kv_cache_dtype=kv)
    values.update(options)
    return model.engine(**values)


def test_an_int8_cache_holds_more_tokens_in_the_same_memory(tiny_qwen3) -> None:  # type: ignore[no-untyped-def]
    fp16, int8 = invariant_engine(tiny_qwen3), invariant_engine(tiny_qwen3, "int8")
    a, b = fp16.describe(), int8.describe()
    assert (a.kv_cache_dtype, b.kv_cache_dtype) == ("float16", "int8")
    # 2 layers x 2 KV heads x K and V: 32 fp16 values (128 bytes) vs 32 codes + one fp16 scale
    assert (a.kv_bytes_per_token, b.kv_bytes_per_token) == (2 * 2 * 2 * 64, 2 * 2 * 2 * 34)
    assert b.kv_bytes_per_token <= 0.55 * a.kv_bytes_per_token
    assert b.kv_capacity_tokens >= 1.8 * a.kv_capacity_tokens
    assert int8.runner.k_all.dtype == torch.int8 and int8.runner.k_all.shape[-1] == 34


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_greedy_tokens_over_an_int8_cache_do_not_depend_on_the_batch_or_the_cache(tiny_qwen3, kv) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_engine import greedy, prompt, run, run_one

    requests = {f"r{s}": (prompt(20 + 7 * s, s), greedy(24)) for s in range(4)}
    engine = invariant_engine(tiny_qwen3, kv)
    alone = {rid: run_one(engine, ids, params, rid).token_ids for rid, (ids, params) in requests.items()}
    together = run(engine, {f"b{rid}": request for rid, request in requests.items()})
    assert all(together[f"b{rid}"].token_ids == alone[rid] for rid in requests)
    again = run_one(engine, *requests["r2"], "cached")  # its prompt's blocks now come from the prefix cache
    assert again.token_ids == alone["r2"]
    assert engine.stats().prefix_cache_hits > 0


def test_int8_cache_logprobs_stay_close_to_the_fp16_cache(tiny_qwen3) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_engine import prompt, run_one

    ids = prompt(60, 4)
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, prompt_logprobs=1
    )
    fp16 = run_one(invariant_engine(tiny_qwen3), ids, params).prompt_logprobs
    int8 = run_one(invariant_engine(tiny_qwen3, "int8"), ids, params).prompt_logprobs
    assert fp16 is not None and int8 is not None
    deltas = [abs(a.logprob - b.logprob) for a, b in zip(fp16[1:], int8[1:], strict=True) if a and b]
    # a random tiny model's logits are sharp (measured 0.029 nats); the real models' figure is
    # bench/quality.py's (--kv-cache-dtype int8)
    assert sum(deltas) / len(deltas) < 0.06


def test_an_int8_cache_is_refused_where_its_kernel_does_not_run(tiny_qwen3, tiny_qwen2) -> None:  # type: ignore[no-untyped-def]
    from argosy.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="int8 needs the invariant kernels"):
        tiny_qwen3.engine(kv_cache_dtype="int8", numerics="fast")
    with pytest.raises(ModelLoadError, match="multiple of 32, not 16"):
        invariant_engine(tiny_qwen2, "int8")  # head dim 16
    with pytest.raises(ModelLoadError, match="bf16: the invariant attention kernel keeps a fp16 or int8"):
        invariant_engine(tiny_qwen3, "bf16")


def test_large_k_biases_get_a_power_of_two_channel_scale_that_keeps_q_dot_k() -> None:
    from argosy.models.llama import cast_for_cache, kv8_channel_scale

    bias = torch.zeros(2 * 64)
    bias[31], bias[63] = 145.0, -3.0  # a RoPE pair (31, 63) of KV head 0: both channels scaled
    bias[64 + 5] = 17.0  # KV head 1, pair (5, 37)
    bias[64 + 6] = 16.0  # at the threshold: not scaled
    scale = kv8_channel_scale(bias, 2, 64)
    assert scale is not None and scale.shape == (2, 64)
    assert scale[0, 31] == scale[0, 63] == 16.0 and scale[1, 5] == scale[1, 37] == 2.0
    assert int((scale != 1.0).sum()) == 4
    assert kv8_channel_scale(torch.full((128,), 3.0), 2, 64) is None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 8, 64, generator=gen),
        torch.randn(3, 2, 64, generator=gen),
        torch.randn(3, 2, 64, generator=gen),
    )
    qs, ks, vs = cast_for_cache(q, k, v, torch.int8, True, scale)
    assert torch.equal(vs, v) and not torch.equal(ks, k)
    # per channel, (q s)(k / s) == q k exactly: the scores' products are the unscaled ones
    assert torch.equal(qs * ks.repeat_interleave(4, dim=1), q * k.repeat_interleave(4, dim=1))
