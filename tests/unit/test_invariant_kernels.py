"""The invariant kernels (argosy/ops/csrc/iq_linear.cpp, iq_attention.cpp): every path the CPU has
gives the scalar reference's bits exactly, a row's result does not depend on the other rows,
and the result is the quantized product it claims to be."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from argosy.ops.composite_linear import PartsLinear
from argosy.ops.native import load_invariant_ops, load_native_ops
from argosy.ops.quantized_linear import (
    BlockCodes,
    CodesEmbedding,
    Int8Linear,
    code_range,
    codes_are_exact,
    invariant_q4_layout,
    invariant_q8_layout,
    q8_group_codes,
)

# no compiler: skipped; a compiler that builds the other native ops must build these too
pytestmark = pytest.mark.skipif(not load_native_ops(), reason="no C++ compiler for the native kernels")


@pytest.fixture(autouse=True)
def built() -> None:
    assert load_invariant_ops(), "the invariant kernels did not build (see the log)"


# 33..43: the AVX-512 Q4 kernel for many rows (from 32) with each remainder of its 6-row blocks
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 13, 33, 40, 43]


@pytest.fixture
def paths() -> Iterator[list[str]]:
    yield list(torch.ops.argosy_iq.paths())
    torch.ops.argosy_iq.set_path("auto")


def q4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    m = (-8 * d * (0.8 + 0.4 * torch.rand(n, k // 32, generator=gen))).half().float()
    return codes, d, m


def q4_dense(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, -1).double()
    groups = q.view(n, -1, 32)
    return (groups * d.double()[..., None] + m.double()[..., None]).view(n, -1)


def rows(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero group quantizes to zeros, not NaN
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def q4(x: torch.Tensor, layout: tuple[torch.Tensor, ...], n: int, out_float32: bool = True) -> torch.Tensor:
    return torch.ops.argosy_iq.q4_linear(x, *layout, n, out_float32)


def q8(x: torch.Tensor, layout: tuple[torch.Tensor, ...], n: int, out_float32: bool = True) -> torch.Tensor:
    """q8_linear told the codes' range, as Int8Linear tells it (the AVX2 path's int16 sums)."""
    return torch.ops.argosy_iq.q8_linear(x, *layout, n, out_float32, *code_range(layout[0]))


@pytest.mark.parametrize(("n", "k"), [(32, 64), (48, 96), (96, 576)])
def test_q4_every_path_gives_the_reference_bits_for_any_row_count(paths: list[str], n: int, k: int) -> None:
    codes, d, m = q4_weight(n, k, seed=n + k)
    layout = invariant_q4_layout(codes, d, m)
    x = rows(max(ROW_COUNTS), k, seed=1)
    torch.ops.argosy_iq.set_path("scalar")
    reference = q4(x, layout, n)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q4(x[:count], layout, n)), bits(reference[:count])), (path, count)
        alone = torch.cat([q4(x[i : i + 1], layout, n) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path
        reversed_rows = q4(x.flip(0).contiguous(), layout, n).flip(0)
        assert torch.equal(bits(reversed_rows), bits(reference)), path


@pytest.mark.parametrize("fine", [False, True])
def test_q4_a_long_prefill_in_passes_gives_the_reference_bits(paths: list[str], fine: bool) -> None:
    """150 rows of 8,192 inputs: the AVX-512 kernel takes x in passes of 128 rows (what fits L2),
    over 3 tiles of outputs (one left over by its blocks of 2)."""
    n, k = 48, 8192
    codes, d, m = q4_weight(n, k, seed=5 + fine)
    layout = invariant_q4_layout(codes, d, m)
    x = rows(150, k, seed=17)
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.q4_linear(x, *layout, n, True, fine)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        got = torch.ops.argosy_iq.q4_linear(x, *layout, n, True, fine)
        assert torch.equal(bits(got), bits(reference)), path


@pytest.mark.parametrize("fine", [False, True])
def test_rows_quantize_alike_on_every_path_at_ties_and_extremes(paths: list[str], fine: bool) -> None:
    """x's quantization (scalar routine vs the AVX-512 ones, one group and four at a time):
    groups whose scaled values land exactly on .5 (round half to even), an all-zero group, a
    lone huge value, negative zero, subnormal groups (127 / amax overflows: the clamp decides)."""
    n, k = 32, 128
    layout = invariant_q4_layout(*q4_weight(n, k, seed=11))
    x = torch.zeros(5, k)
    x[0, :32] = torch.arange(32) - 15.5  # amax 127 below, so the scale is 1: every value a tie
    x[0, 31] = 127.0
    x[0, 64:96] = -0.0
    x[1, :32] = torch.linspace(-1.0, 1.0, 32)
    x[1, 40] = 3.0e38
    x[2] = torch.randn(k, generator=torch.Generator().manual_seed(12)) * 1e-30
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(13)) * 1e-39
    x[4, :96] = x[0, :96]
    x[4, 97] = 1e-44
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.q4_linear(x, *layout, n, True, fine)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(torch.ops.argosy_iq.q4_linear(x, *layout, n, True, fine)), bits(reference)), (
            path
        )


def test_q4_is_the_quantized_product(paths: list[str]) -> None:
    n, k = 64, 576
    codes, d, m = q4_weight(n, k, seed=7)
    layout = invariant_q4_layout(codes, d, m)
    x = rows(9, k, seed=2, dtype=torch.float32)
    exact = x.double() @ q4_dense(codes, d, m).T
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        got = q4(x, layout, n).double()
        # x is quantized to int8 per group of 32 (as llama.cpp's Q8_0): ~0.5% RMS off here (uncentred codes: ~1%)
        assert (got - exact).norm() < 0.007 * exact.norm(), path


def q8_0_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized and dequantized as llama.cpp's Q8_0 (per group of 32, float64)."""
    groups = x.float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # float32 tensor / tensor (a Python float over a tensor may round differently: a group of
    # bf16 values then lands on the other side of .5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    dx = amax / torch.full_like(amax, 127.0)
    return (torch.round(groups * inv).clamp(-127, 127).double() * dx.double()).view_as(x)


def test_q4_is_the_weights_times_the_quantized_rows_whatever_the_blocks_offset(paths: list[str]) -> None:
    """The error of quantizing x is sum w_k (x^_k - x_k) (llama.cpp's), whatever a Q4_1 block's
    minimum: blocks far off-centre (all weights positive, or one outlier) come out the same as
    centred ones, within fp32 rounding of the exact product with the quantized rows."""
    n, k = 48, 192
    gen = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    m = (d * torch.randn(n, k // 32, generator=gen) * 12).half().float()  # off-centre blocks
    layout = invariant_q4_layout(codes, d, m)
    x = rows(7, k, seed=22, dtype=torch.float32)
    product = q8_0_rows(x) @ q4_dense(codes, d, m).T
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        got = q4(x, layout, n).double()
        assert (got - product).abs().max() < 1e-5 * product.abs().max(), path


def test_q4_bf16_output_is_the_float_output_rounded(paths: list[str]) -> None:
    n, k = 48, 96
    layout = invariant_q4_layout(*q4_weight(n, k, seed=3))
    x = rows(5, k, seed=4)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        as_float = q4(x, layout, n, out_float32=True)
        as_bf16 = q4(x, layout, n, out_float32=False)
        assert as_bf16.dtype == torch.bfloat16
        assert torch.equal(bits(as_bf16), bits(as_float.to(torch.bfloat16))), path


def q8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 weight: codes with a +-127 in each group, float16 scales."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    codes.view(n, k // 32, 32)[:, :, 5] = 127
    return codes, (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()


def q8_dense(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.double().view(n, k // 32, 32) * scales.double()[..., None]).view(n, k)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (160, 576)])
def test_q8_every_path_gives_the_reference_bits_for_any_row_count(paths: list[str], n: int, k: int) -> None:
    codes, scales = q8_weight(n, k, seed=n)
    layout = invariant_q8_layout(codes, scales)
    x = rows(max(ROW_COUNTS), k, seed=5)
    torch.ops.argosy_iq.set_path("scalar")
    reference = q8(x, layout, n)
    exact = x.double() @ q8_dense(codes, scales).T
    assert (reference.double() - exact).norm() < 0.01 * exact.norm()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q8(x[:count], layout, n)), bits(reference[:count])), (path, count)
        alone = torch.cat([q8(x[i : i + 1], layout, n) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path


def test_q8_group_codes_give_a_q8_0_weight_back_exactly() -> None:
    """The float32 values of a GGUF Q8_0 weight (d * q, exact) requantize to its own codes and
    scales, so the output head runs on the file's weights, not on a second quantization."""
    codes, scales = q8_weight(40, 96, seed=9)
    codes[3, :32] = 0  # an all-zero group: scale 0, codes 0
    dense = q8_dense(codes, scales).float()
    got_codes, got_scales = q8_group_codes(lambda a, b: dense[a:b], 40, 96)
    expected_scales = scales.clone()
    expected_scales[3, 0] = 0
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_scales.view(torch.int16), expected_scales.view(torch.int16))


def test_a_tied_q8_0_table_embeds_from_the_head_codes_exactly() -> None:
    """A tied Q8_0 table: each token's embedding read back from the head's codes is the file's
    float32 row bit for bit (a bf16 table rounds it); a table its codes do not give back (float
    weights quantized) keeps its own float rows (codes_are_exact is False)."""
    codes, scales = q8_weight(48, 64, seed=13)
    dense = q8_dense(codes, scales).float()
    head = Int8Linear(
        dense.to(torch.bfloat16), None, torch.bfloat16, invariant=True, weight_rows=lambda a, b: dense[a:b]
    )
    assert codes_are_exact(head, lambda a, b: dense[a:b])
    ids = torch.tensor([[0, 17, 47], [5, 5, 31]])
    got = CodesEmbedding(head)(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 64)
    assert torch.equal(got, dense[ids])
    assert not torch.equal(dense[ids].to(torch.bfloat16).float(), dense[ids])  # what bf16 would lose
    floats = torch.randn(48, 64, generator=torch.Generator().manual_seed(14))
    approximate = Int8Linear(
        floats, None, torch.bfloat16, invariant=True, weight_rows=lambda a, b: floats[a:b]
    )
    assert not codes_are_exact(approximate, lambda a, b: floats[a:b])


def block_weight(n: int, k: int, group: int, with_mins: bool, seed: int) -> BlockCodes:
    """Codes, scales per `group` (some negative, as Q6_K's int8 sub-scales can be) and, with
    mins, a minimum per 32: the int8 form of a GGUF block format."""
    gen = torch.Generator().manual_seed(seed)
    low = 0 if with_mins else -32
    codes = torch.randint(low, low + 64 if with_mins else 32, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4) * torch.where(
        torch.rand(n, k // group, generator=gen) < 0.2, -1.0, 1.0
    )
    mins = -(torch.rand(n, k // 32, generator=gen) * 0.3) if with_mins else None
    return BlockCodes(codes, scales, mins)


def block_values(b: BlockCodes) -> torch.Tensor:
    """float32 codes * scale (+ min), as the gguf package dequantizes (d * sc) * q - dmin * m."""
    n, k = b.codes.shape
    values = (b.codes.float().view(n, -1, b.group) * b.scales.float()[..., None]).view(n, k)
    if b.mins is not None:
        values = (values.view(n, -1, 32) + b.mins.float()[..., None]).view(n, k)
    return values


@pytest.mark.parametrize(("group", "with_mins"), [(16, False), (16, True), (32, True), (32, False)])
def test_block_codes_give_the_reference_bits_on_every_path_and_the_quantized_product(
    paths: list[str], group: int, with_mins: bool
) -> None:
    """The int8 form of Q5_0 ... Q6_K (scales per 32 or 16, mins or none): every path gives the
    scalar reference's bits at every row count, and the result is the weights times the
    quantized rows within fp32 rounding."""
    n, k = 48, 256
    weight = block_weight(n, k, group, with_mins, seed=group + with_mins)
    layout = invariant_q8_layout(weight.codes, weight.scales, weight.mins)
    x = rows(max(ROW_COUNTS), k, seed=31)
    torch.ops.argosy_iq.set_path("scalar")
    reference = q8(x, layout, n)
    product = q8_0_rows(x.float()) @ block_values(weight).double().T
    assert (reference.double() - product).abs().max() < 1e-5 * product.abs().max()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q8(x[:count], layout, n)), bits(reference[:count])), (path, count)
        alone = torch.cat([q8(x[i : i + 1], layout, n) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize(
    ("lo", "hi"), [(0, 15), (0, 16), (-16, 15), (-16, 16), (-32, 31), (-32, 32), (-33, 32)]
)
def test_narrow_code_ranges_give_the_reference_bits_at_their_extremes(
    paths: list[str], group: int, lo: int, hi: int
) -> None:
    """Codes of a narrow range (Q4_K 0..15, Q5_0 -16..15, Q6_K -32..31: the AVX2 path sums
    their byte products in int16, as many as the range allows) at its extremes, times rows at
    +-127: every path gives the scalar reference's bits, at each range's edge and one past it
    (where fewer products share an int16 sum)."""
    n, k = 32, 256
    gen = torch.Generator().manual_seed(hi - lo + group)
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    codes[: n // 4] = hi  # whole rows at each end: the largest sums
    codes[n // 4 : n // 2] = lo
    codes[n // 2, 0], codes[n // 2, 1] = lo, hi  # the range itself is in the codes
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    mins = -(torch.rand(n, k // 32, generator=gen) * 0.3)
    layout = invariant_q8_layout(codes, scales, mins)
    assert code_range(layout[0]) == (lo, hi)
    x = rows(max(ROW_COUNTS), k, seed=hi)
    x[0], x[1] = 1.0, -1.0  # every x code +127, then -127
    x[2, ::2] = 50.0  # half the codes +127, the rest small
    torch.ops.argosy_iq.set_path("scalar")
    reference = q8(x, layout, n)
    product = q8_0_rows(x.float()) @ block_values(BlockCodes(codes, scales, mins)).double().T
    assert (reference.double() - product).abs().max() < 1e-5 * product.abs().max()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q8(x[:count], layout, n)), bits(reference[:count])), (path, count)


def test_q8_refuses_a_code_range_outside_int8() -> None:
    codes, scales = q8_weight(16, 64, seed=3)
    layout = invariant_q8_layout(codes, scales)
    with pytest.raises(RuntimeError, match="code_lo and code_hi"):
        torch.ops.argosy_iq.q8_linear(rows(2, 64, seed=1), *layout, 16, True, -128, 127)


@pytest.mark.parametrize(("group", "with_mins"), [(32, False), (32, True), (16, False)])
def test_q8_scales_held_as_float16_where_exact_give_the_float32_forms_bits(
    paths: list[str], group: int, with_mins: bool
) -> None:
    """Scales and mins that are all float16 values (Q8_0, Q5_0, Q5_1) are held so, half the
    bytes; one value that is not keeps the whole tensor in float32; both forms give the same
    bits on every path."""
    n, k = 32, 128
    weight = block_weight(n, k, group, with_mins, seed=7 + group)
    weight.scales = weight.scales.half().float()
    if weight.mins is not None:
        weight.mins = weight.mins.half().float()
    half = invariant_q8_layout(weight.codes, weight.scales, weight.mins)
    assert half[1].dtype == torch.float16 and (half[2] is None or half[2].dtype == torch.float16)
    full = tuple(None if t is None else (t.float() if t.is_floating_point() else t) for t in half)
    nudged = weight.scales.clone()
    nudged[0, 0] = nudged[0, 0] * (1 + 2**-20)  # not a float16 value
    assert invariant_q8_layout(weight.codes, nudged, weight.mins)[1].dtype == torch.float32
    x = rows(max(ROW_COUNTS), k, seed=3)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q8(x[:count], half, n)), bits(q8(x[:count], full, n))), (path, count)


def test_fused_parts_of_different_formats_keep_every_value() -> None:
    """A fused layer whose parts are Q4_K-like (per 32, mins) and Q6_K-like (per 16, none), as
    Q4_K_M files mix them: one form (per 16, zero mins where none) with every value kept, read
    back exactly through the embedding; a code of -128 is refused."""
    a, b = block_weight(16, 64, 32, True, seed=41), block_weight(32, 64, 16, False, seed=42)
    fused = BlockCodes.cat([a, b])
    assert fused.group == 16 and fused.mins is not None
    expected = torch.cat([block_values(a), block_values(b)])
    assert torch.equal(block_values(fused), expected)
    head = Int8Linear(None, None, torch.bfloat16, invariant=True, blocks=fused)
    assert torch.equal(CodesEmbedding(head)(torch.arange(48)), expected)
    b.codes[0, 0] = -128
    with pytest.raises(ValueError, match="-128"):
        invariant_q8_layout(b.codes, b.scales)


def test_a_parts_layer_splits_its_outputs_without_joining_them_where_its_parts_end_at_cuts() -> None:
    """PartsLinear.split (the q, k, v of a Q4_K_M file's layer, q and k in one part, v in the
    other): forward's values cut at the sizes, each piece a view of one part's output; None where
    a part ends inside a piece."""
    a, b = block_weight(48, 64, 32, True, seed=43), block_weight(16, 64, 16, False, seed=44)
    layer = PartsLinear([Int8Linear(None, None, torch.float32, invariant=True, blocks=w) for w in (a, b)])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(45))
    pieces = layer.split(x, [32, 16, 16])
    assert pieces is not None and [p.shape[-1] for p in pieces] == [32, 16, 16]
    for piece, expected in zip(pieces, layer(x).split([32, 16, 16], dim=-1), strict=True):
        assert torch.equal(piece, expected)
    assert pieces[0].data_ptr() + 32 * 4 == pieces[1].data_ptr()  # views of the first part's output
    assert layer.split(x, [40, 24]) is None  # the first part ends at 48, inside the second piece
    assert layer.split(x, [48, 8]) is None  # not the layer's width


def every_path_gives_its_bits_together_and_alone(
    paths: list[str], op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reference: torch.Tensor
) -> None:
    """A row-wise op: on every path, x's rows in one call and one at a time give reference's bits."""
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(op(x)), bits(reference)), path
        alone = torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_geglu_gives_the_scalar_bits_on_every_path_and_gelu_tanh_times_up(
    paths: list[str], dtype: torch.dtype
) -> None:
    """gelu_tanh(gate) * up in one pass: every path gives the scalar reference's bits (a width
    that leaves a remainder for the vector paths; large, tiny, zero and negative gates), and the
    value is float64's within one rounding of the output (and a few fp32 ulps before it)."""
    gen = torch.Generator().manual_seed(17)
    rows, inter = 5, 2 * 1024 + 24
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 3
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 40.0, -40.0, 1e4, -1e4])
    gate_up = gate_up.to(dtype)
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.geglu(gate_up)
    assert reference.dtype == dtype and reference.shape == (rows, inter)
    g, u = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    exact = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
    # one rounding of the output, plus 1 + tanh's cancellation where gelu is near 0 (fp32's ulp of
    # 1 times |g u| / 2: aten's gelu is as far there)
    tolerance = (2**-8 if dtype == torch.bfloat16 else 1e-6) * exact.abs() + 1e-7 * (g * u).abs()
    assert bool(((reference.double() - exact).abs() <= tolerance).all())
    every_path_gives_its_bits_together_and_alone(paths, torch.ops.argosy_iq.geglu, gate_up, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_gives_the_scalar_bits_on_every_path_and_silu_times_up(
    paths: list[str], dtype: torch.dtype
) -> None:
    """silu(gate) * up in one pass: every path gives the scalar reference's bits (a remainder for
    the vector paths; large, tiny, zero and negative gates: exp's argument is never positive),
    float64's value within a few fp32 ulps before the output's one rounding, and aten's silu
    times up within bf16's roundings."""
    gen = torch.Generator().manual_seed(19)
    rows, inter = 5, 2 * 1024 + 24
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    gate_up[0, :10] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 40.0, -40.0, 1e4, -1e4, 88.0, -120.0])
    gate_up = gate_up.to(dtype)
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.swiglu(gate_up)
    assert reference.dtype == dtype and reference.shape == (rows, inter)
    g, u = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    exact = g * torch.sigmoid(g) * u
    # exp's argument is held at -87 (iq_exp.h): silu(g) for g < -87 is ~1e-36 g, not 0
    tolerance = (2**-8 if dtype == torch.bfloat16 else 4e-7) * exact.abs() + 1e-32
    assert bool(((reference.double() - exact).abs() <= tolerance).all())
    aten = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).float()  # rounds twice
    tolerance = (2**-6 if dtype == torch.bfloat16 else 1e-6) * aten.abs() + 1e-32
    assert bool(((reference.float() - aten).abs() <= tolerance).all())
    every_path_gives_its_bits_together_and_alone(paths, torch.ops.argosy_iq.swiglu, gate_up, reference)


@pytest.mark.parametrize(("dim", "offset"), [(640, 1.0), (256, 1.0), (576, 0.0), (45, 1.0)])
def test_rms_norm_gives_the_scalar_bits_on_every_path_and_the_float64_norm(
    paths: list[str], dim: int, offset: float
) -> None:
    """x / rms(x) * (offset + w) with the float64 sum of squares in one fixed order: every path
    gives the scalar reference's bits (a width with a remainder too), a row alone the same as
    beside others, and float64's value within a few fp32 roundings."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(7, dim, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0  # all zero: eps keeps it finite
    w = torch.randn(dim, generator=gen) * 0.1
    eps = 1e-6
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.rms_norm(x, w, eps, offset)
    xd = x.double()
    exact = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())
    assert bool(((reference.double() - exact).abs() <= 1e-6 * exact.abs() + 1e-30).all())
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(torch.ops.argosy_iq.rms_norm(x, w, eps, offset)), bits(reference)), path
        alone = torch.cat([torch.ops.argosy_iq.rms_norm(x[i : i + 1], w, eps, offset) for i in range(7)])
        assert torch.equal(bits(alone), bits(reference)), path
        # read in place: rows of a wider tensor (k of a fused projection), heads of a token (q)
        fused = torch.cat(
            [torch.randn(7, 3, generator=gen), x, x.flip(0), torch.randn(7, 5, generator=gen)], 1
        )
        strided = torch.ops.argosy_iq.rms_norm(fused[:, 3 : 3 + dim], w, eps, offset)
        assert strided.is_contiguous() and torch.equal(bits(strided), bits(reference)), path
        heads = torch.ops.argosy_iq.rms_norm(fused[:, 3 : 3 + 2 * dim].view(7, 2, dim), w, eps, offset)
        assert heads.shape == (7, 2, dim) and heads.is_contiguous(), path
        assert torch.equal(bits(heads[:, 0]), bits(reference)), path
        assert torch.equal(bits(heads[:, 1]), bits(reference.flip(0))), path


@pytest.mark.parametrize(
    ("heads", "dim", "table_dtype"),
    [(4, 256, torch.bfloat16), (1, 256, torch.float32), (9, 64, torch.bfloat16)],
)
def test_rope_gives_the_bits_of_the_python_statement_on_every_path(
    paths: list[str], heads: int, dim: int, table_dtype: torch.dtype
) -> None:
    """The eager step's native RoPE is x * cos + rotate_half(x) * sin with the same roundings as
    aten's (and the compiled graph's) statement, bit for bit, for a table sliced out of a wider
    one (Gemma's global/local halves) and a bf16 table."""
    from argosy.models.llama import apply_rope

    gen = torch.Generator().manual_seed(dim + heads)
    x = torch.randn(37, heads, dim, generator=gen) * 3
    table = torch.randn(37, 1, 2 * dim, generator=gen).to(table_dtype)
    cos, sin = table[..., dim:], table[..., :dim]
    half = dim // 2
    statement = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    # x read in place too: q of a fused projection's output, its tokens a row of it apart
    fused = torch.cat([x.reshape(37, -1), torch.randn(37, 2 * dim, generator=gen)], dim=1)
    in_place = fused[:, : heads * dim].view(37, heads, dim)
    assert not in_place.is_contiguous()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(apply_rope(x, cos, sin)), bits(statement)), path
        assert torch.equal(bits(apply_rope(in_place, cos, sin)), bits(statement)), path


def test_paths_are_named_and_a_missing_one_is_refused(paths: list[str]) -> None:
    assert paths[0] == "scalar"
    assert torch.ops.argosy_iq.set_path("scalar") == "scalar"
    assert torch.ops.argosy_iq.path() == "scalar"
    assert torch.ops.argosy_iq.set_path("auto") == paths[-1]
    with pytest.raises(RuntimeError, match="unknown path"):
        torch.ops.argosy_iq.set_path("neon")


# -- attention ----------------------------------------------------------------------------------

BLOCK = 16


def attention_case(seed: int, dim: int = 64, heads: int = 9, kv_heads: int = 3):  # type: ignore[no-untyped-def]
    """Two sequences in shuffled cache blocks: a prefill chunk of the first (positions 5..41,
    each row seeing up to itself) and a decode row of each."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 12
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=gen).half()
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=gen).half()
    order = torch.randperm(num_blocks, generator=gen)
    tables = [order[:3], order[3:8]]  # 48 and 80 positions of room
    rows = [(0, p) for p in range(5, 42)] + [(0, 47), (1, 70)]  # (sequence, position)
    max_blocks = max(len(t) for t in tables)
    block_ids = torch.zeros(len(rows), max_blocks, dtype=torch.long)
    mask = torch.zeros(len(rows), 1, 1, max_blocks * BLOCK, dtype=torch.bool)
    slots = torch.empty(len(rows), dtype=torch.long)
    for i, (s, p) in enumerate(rows):
        block_ids[i, : len(tables[s])] = tables[s]
        mask[i, 0, 0, : p + 1] = True
        slots[i] = tables[s][p // BLOCK] * BLOCK + p % BLOCK
    q = torch.randn(len(rows), heads, dim, generator=gen)
    k = torch.randn(len(rows), kv_heads, dim, generator=gen).half()
    v = torch.randn(len(rows), kv_heads, dim, generator=gen).half()
    return q, k, v, k_cache, v_cache, slots, block_ids.view(-1), mask


def attend(case, rows: slice | torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[slots], v_cache[slots] = k, v  # every row's K/V in place, as a whole step writes them
    if rows is not None:
        max_blocks = block_ids.numel() // q.shape[0]
        q, k, v, slots, mask = q[rows], k[rows], v[rows], slots[rows], mask[rows]
        block_ids = block_ids.view(-1, max_blocks)[rows].reshape(-1)
    return torch.ops.argosy_iq.attention(
        q, k, v, k_cache.clone(), v_cache.clone(), slots, block_ids, mask, BLOCK
    )


@pytest.mark.parametrize("dim", [64, 128])
def test_attention_every_path_gives_the_reference_bits_and_rows_do_not_depend_on_each_other(
    paths: list[str], dim: int
) -> None:
    case = attention_case(seed=dim, dim=dim)
    torch.ops.argosy_iq.set_path("scalar")
    reference = attend(case)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(attend(case)), bits(reference)), path
        alone = torch.cat([attend(case, slice(i, i + 1)) for i in range(reference.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path
        assert torch.equal(bits(attend(case, slice(3, 20))), bits(reference[3:20])), path


def test_attention_is_softmax_attention_over_each_rows_visible_positions() -> None:
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case = attention_case(seed=5)
    got = attend(case).double()
    k_all, v_all = k_cache.clone(), v_cache.clone()
    k_all[slots], v_all[slots] = k, v
    max_blocks = block_ids.numel() // q.shape[0]
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    for i in range(q.shape[0]):
        n = int(mask[i].sum())
        table = block_ids.view(-1, max_blocks)[i]
        positions = torch.arange(n)
        where = table[positions // BLOCK] * BLOCK + positions % BLOCK
        keys = k_all[where].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        values = v_all[where].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), keys) / dim**0.5, dim=-1)
        expected = torch.einsum("hn,nhd->hd", weights, values).reshape(-1)
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-5)


def paged_case(seed: int, rooms: list[int], rows: list[tuple[int, int]], dim: int, heads: int, kv_heads: int):  # type: ignore[no-untyped-def]
    """Sequences with `rooms[s]` positions of room in shuffled cache blocks; a row (s, n) of
    sequence s sees its positions 0 .. n - 1 (n = 0: none) and writes its K/V at n - 1 (or 0)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-room // BLOCK) for room in rooms]
    num_blocks = sum(counts)
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=gen).half()
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=gen).half()
    order = torch.randperm(num_blocks, generator=gen)
    tables = list(order.split(counts))
    max_blocks = max(counts)
    block_ids = torch.zeros(len(rows), max_blocks, dtype=torch.long)
    mask = torch.zeros(len(rows), 1, 1, max_blocks * BLOCK, dtype=torch.bool)
    slots = torch.empty(len(rows), dtype=torch.long)
    for i, (s, n) in enumerate(rows):
        block_ids[i, : counts[s]] = tables[s]
        mask[i, 0, 0, :n] = True
        p = max(n - 1, 0)
        slots[i] = tables[s][p // BLOCK] * BLOCK + p % BLOCK
    # scores of a few units: an fp32 rounding step taken differently shows in the output
    q = torch.randn(len(rows), heads, dim, generator=gen) * 4
    k = torch.randn(len(rows), kv_heads, dim, generator=gen).half()
    v = torch.randn(len(rows), kv_heads, dim, generator=gen).half()
    return q, k, v, k_cache, v_cache, slots, block_ids.view(-1), mask


def assert_every_path_gives_the_reference_bits(paths: list[str], case) -> None:  # type: ignore[no-untyped-def]
    """Each path equals the scalar statement bit for bit, and a row's bits do not depend on
    which rows share its call (alone, reversed, every third), nor on the thread count."""
    torch.ops.argosy_iq.set_path("scalar")
    reference = attend(case)
    count = reference.shape[0]
    threads = torch.get_num_threads()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(attend(case)), bits(reference)), path
        alone = torch.cat([attend(case, slice(i, i + 1)) for i in range(count)])
        assert torch.equal(bits(alone), bits(reference)), path
        backwards = torch.arange(count - 1, -1, -1)
        assert torch.equal(bits(attend(case, backwards)), bits(reference[backwards])), path
        assert torch.equal(bits(attend(case, slice(1, None, 3))), bits(reference[1::3])), path
        torch.set_num_threads(1)
        try:
            assert torch.equal(bits(attend(case)), bits(reference)), (path, "one thread")
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_attention_decode_rows_give_the_reference_bits_on_every_path(
    paths: list[str], dim: int, group: int
) -> None:
    """One row per sequence (a decode step): lengths around the 16-position lanes and the
    64-position chunks, and a row that sees nothing."""
    lengths = [1, 7, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 0] + list(range(40, 300, 9))
    case = paged_case(dim + group, [max(n, 1) for n in lengths], list(enumerate(lengths)), dim, 4 * group, 4)
    assert_every_path_gives_the_reference_bits(paths, case)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("start", [0, 89])
def test_attention_prefill_rows_give_the_reference_bits_on_every_path(
    paths: list[str], dim: int, group: int, start: int
) -> None:
    """Many rows of one sequence (a prefill chunk from position `start`), each seeing up to
    itself, so rows share K/V loads; plus a decode row of another sequence in the same call."""
    rows = [(0, n) for n in range(start + 1, start + 72)] + [(1, 45)]
    case = paged_case(3 * dim + group + start, [start + 71, 45], rows, dim, 4 * group, 4)
    assert_every_path_gives_the_reference_bits(paths, case)


@pytest.mark.parametrize("dim", [16, 32, 48, 80, 96, 112, 256])
def test_attention_other_head_dims_give_the_reference_bits_on_every_path(paths: list[str], dim: int) -> None:
    """Every multiple of 16 up to 128 has a vector path: a prefill chunk and decode rows."""
    rows = [(0, n) for n in range(30, 70)] + [(1, 1), (2, 77), (3, 0)]
    case = paged_case(dim, [69, 1, 77, 1], rows, dim, 6, 2)
    assert_every_path_gives_the_reference_bits(paths, case)


@pytest.mark.parametrize("dim", [64, 256])
def test_attention_over_a_sliding_window_is_softmax_attention_over_it_on_every_path(
    paths: list[str], dim: int
) -> None:
    """Rows that see only their last W positions (Gemma 3's local layers): mask rows that are one
    run s .. n-1. Every path gives the scalar statement's bits, and the result is softmax
    attention over exactly those positions."""
    window = 21
    rows = [(0, n) for n in range(1, 80)] + [(1, 45), (1, 3)]
    case = paged_case(7 * dim, [79, 45], rows, dim, 4, 1)
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    for i, (_, n) in enumerate(rows):  # positions n - window .. n - 1
        mask[i, 0, 0, : max(n - window, 0)] = False
    assert_every_path_gives_the_reference_bits(paths, case)
    torch.ops.argosy_iq.set_path("auto")
    got = attend(case).double()
    k_all, v_all = k_cache.clone(), v_cache.clone()
    k_all[slots], v_all[slots] = k, v
    max_blocks = block_ids.numel() // q.shape[0]
    for i, (_, n) in enumerate(rows):
        positions = torch.arange(max(n - window, 0), n)
        table = block_ids.view(-1, max_blocks)[i]
        where = table[positions // BLOCK] * BLOCK + positions % BLOCK
        keys = k_all[where].double().repeat_interleave(4, dim=1)
        values = v_all[where].double().repeat_interleave(4, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), keys) / dim**0.5, dim=-1)
        expected = torch.einsum("hn,nhd->hd", weights, values).reshape(-1)
        torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-4)


def test_a_sliding_window_past_the_first_chunks_never_reads_them(paths: list[str]) -> None:
    """Rows whose window starts past whole 64-position chunks: those chunks are skipped (not read
    and weighted by 0). Poisoned with NaN there, every path still gives the reference's bits,
    finite, whatever rows share the call (a row alone skips from its own window)."""
    window, dim = 21, 64
    rows = [(0, n) for n in range(150, 230)] + [(1, 200)]
    case = paged_case(11, [229, 200], rows, dim, 4, 1)
    q, k, v, k_cache, v_cache, slots, block_ids, mask = case
    for i, (_, n) in enumerate(rows):
        mask[i, 0, 0, : n - window] = False
    max_blocks = block_ids.numel() // q.shape[0]
    for i in (0, len(rows) - 1):  # each sequence's positions 0 .. 127: two chunks before any window
        positions = torch.arange(128)
        where = block_ids.view(-1, max_blocks)[i][positions // BLOCK] * BLOCK + positions % BLOCK
        k_cache[where], v_cache[where] = float("nan"), float("nan")
    assert_every_path_gives_the_reference_bits(paths, case)
    torch.ops.argosy_iq.set_path("auto")
    assert torch.isfinite(attend(case)).all()


def test_attention_reads_every_fp16_value_exactly(paths: list[str]) -> None:
    """K and V hold fp16 values of every exponent (subnormals, -0, the largest finite): with one
    position per row the output is that position's V exactly, and the scores reach the softmax
    as the scalar statement reads them, on every path."""
    gen = torch.Generator().manual_seed(31)
    bits16 = torch.randint(0, 1 << 16, (40 * 4 * 64,), generator=gen, dtype=torch.int32)
    finite = bits16[(bits16 & 0x7C00) != 0x7C00][: 40 * 4 * 64 // 2]  # no inf / NaN
    values = finite.to(torch.int16).view(torch.float16).view(-1, 4, 64)[:40]
    values[0, 0, :4] = torch.tensor([-0.0, 6.0e-8, -65504.0, 65504.0], dtype=torch.float16)
    rows = [(s, 1) for s in range(values.shape[0])]
    q, k, v, k_cache, v_cache, slots, block_ids, mask = paged_case(32, [1] * len(rows), rows, 64, 8, 4)
    k, v = (values / 65504 * 8).half(), values  # K scaled down: scores stay finite
    case = (q, k, v, k_cache, v_cache, slots, block_ids, mask)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        got = attend(case).view(len(rows), 8, 64)
        assert torch.equal(got, v.float().repeat_interleave(2, dim=1)), path
    assert_every_path_gives_the_reference_bits(paths, case)


def test_greedy_is_torch_argmax_and_flags_nan_and_inf_rows_on_every_path(paths: list[str]) -> None:
    v = 151936 + 3  # Qwen2.5's vocabulary and a tail shorter than a vector
    x = torch.randn(9, v + 4, generator=torch.Generator().manual_seed(5))[:, :v]  # rows strided
    x[1] = x[1].round()  # ties: the first of them wins
    x[2] = float("-inf")  # a fully masked row: index 0, as torch
    x[3, ::2] = float("-inf")
    x[4, 100] = x[4].max() + 1
    x[4, v - 1] = x[4, 100]  # its tie in the tail comes second
    x[5, 7] = float("nan")
    x[6, v - 2] = float("inf")
    x[7, v - 1] = float("nan")
    bad = [0, 0, 0, 0, 0, 1, 1, 1, 0]
    ok = [i for i, b in enumerate(bad) if not b]
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        got = torch.ops.argosy_iq.greedy(x)
        assert got[:, 1].tolist() == bad, path
        assert torch.equal(got[ok, 0], x[ok].argmax(dim=-1)), path
        assert got[4, 0].item() == 100 and got[2, 0].item() == 0
        assert got[5:8, 0].tolist() == [0, 0, 0], path


@pytest.mark.parametrize("op_name", ["geglu", "swiglu"])
def test_a_prefill_sized_gated_output_streamed_keeps_the_bits(paths: list[str], op_name: str) -> None:
    """From 2^20 output values (a prefill's) the vector path writes with non-temporal stores:
    the same bits as the scalar path, and as each row alone (ordinary stores)."""
    gate_up = torch.randn(64, 2 * 16384, generator=torch.Generator().manual_seed(23)) * 4
    op = getattr(torch.ops.argosy_iq, op_name)
    torch.ops.argosy_iq.set_path("scalar")
    reference = op(gate_up)
    every_path_gives_its_bits_together_and_alone(paths, op, gate_up, reference)
