"""Codes held at the file's bits (argosy/ops/csrc/iq_packed.cpp, argosy/ops/packed_codes.py): for
each GGUF format's form (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) every path the CPU has gives, at any row
count and whatever the other rows, exactly the bits q8_linear's scalar reference gives on the
same weight held as int8 codes and float32 scales; the planes give the codes back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from argosy.ops.native import load_invariant_ops, load_native_ops
from argosy.ops.packed_codes import PackedCodes, SuperScales
from argosy.ops.quantized_linear import BlockCodes, Int8Linear, code_range, invariant_q8_layout

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="no C++ compiler for the native kernels")

# 33..35: the AVX2 prefill path (from 32 rows) with each remainder of its 3- and 2-row blocks;
# 33..55: the AVX-512 one (from 16 rows) with each remainder of its 6- and 4-row blocks
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 9, 13, 33, 34, 35, 48, 49, 50, 51, 52, 53, 55]


@pytest.fixture(autouse=True)
def built() -> None:
    assert load_invariant_ops(), "the invariant kernels did not build (see the log)"


@pytest.fixture
def paths() -> Iterator[list[str]]:
    yield list(torch.ops.argosy_iq.paths())
    torch.ops.argosy_iq.set_path("auto")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def kquant(
    fmt: str, n: int, k: int, seed: int, extreme: bool = False
) -> tuple[BlockCodes, SuperScales | None]:
    """A random weight in a format's own form: its int8 codes, float32 scales (and mins) as
    gguf_quant computes them, and the K-quants' own scales. `extreme`: every code at its
    format's edge (the AVX2 path's int16 sums at their bound)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = {"q4_k": (0, 15), "q5_k": (0, 31), "q6_k": (-32, 31), "q5_0": (-16, 15), "q5_1": (0, 31)}[fmt]
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    if extreme:
        codes = torch.where(torch.rand(n, k, generator=gen) < 0.5, lo, hi).to(torch.int8)
    if fmt in ("q5_0", "q5_1"):
        d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
        m = (-(torch.rand(n, k // 32, generator=gen) * 0.3)).half() if fmt == "q5_1" else None
        return BlockCodes(codes, d.float(), None if m is None else m.float()), None
    supers = k // 256
    d = (torch.rand(n, supers, generator=gen) * 0.001 + 1e-5).half()
    if fmt == "q6_k":
        sc = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
        scales = d.float().repeat_interleave(16, dim=1) * sc.float()
        return BlockCodes(codes, scales), SuperScales(sc, d)
    sc = torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8)
    mn = torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8)
    dmin = (torch.rand(n, supers, generator=gen) * 0.001).half()
    scales = d.float().repeat_interleave(8, dim=1) * sc.float()
    mins = -(dmin.float().repeat_interleave(8, dim=1) * mn.float())
    return BlockCodes(codes, scales, mins), SuperScales(sc, d, mn, dmin)


FORMATS = ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1"]
BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6, "q5_0": 5, "q5_1": 5}


def packed(weight: BlockCodes, super_scales: SuperScales | None) -> PackedCodes:
    form = PackedCodes.of(weight.codes, weight.scales, weight.mins, super_scales, *code_range(weight.codes))
    assert form is not None
    return form


def weight_blocks(weight: BlockCodes, super_scales: SuperScales | None) -> BlockCodes:
    return BlockCodes(weight.codes, weight.scales, weight.mins, super_scales)


def packed_layer(weight: BlockCodes, super_scales: SuperScales | None) -> Int8Linear:
    """An invariant bf16 layer holding the weight's own codes (packed where a kernel serves them)."""
    return Int8Linear(
        None,
        None,
        torch.bfloat16,
        invariant=True,
        blocks=weight_blocks(weight, super_scales),
    )


def rows(m: int, k: int, seed: int, extreme: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    if extreme:  # every quantized x at +-127
        x = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    x[0, :32] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fine", [False, True])
def test_a_long_prefill_in_passes_gives_the_reference_bits(paths: list[str], fmt: str, fine: bool) -> None:
    """150 rows of 8,192 inputs: the prefill paths take x in passes of 128 rows (what fits L2),
    over 3 tiles of outputs (one left over by the blocks of 2)."""
    n, k = 48, 8192
    weight, super_scales = kquant(fmt, n, k, seed=3 + fine)
    kq = packed(weight, super_scales)
    x = rows(150, k, seed=21)
    torch.ops.argosy_iq.set_path("scalar")
    reference = kq.linear(x, n, True, fine=fine)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        assert torch.equal(bits(kq.linear(x, n, True, fine=fine)), bits(reference)), path


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("extreme", [False, True])
def test_every_path_gives_the_int8_forms_reference_bits(paths: list[str], fmt: str, extreme: bool) -> None:
    n, k = 64, 512  # 4 tiles: the prefill paths' blocks of 2 tiles
    weight, super_scales = kquant(fmt, n, k, seed=len(fmt) + extreme, extreme=extreme)
    kq = packed(weight, super_scales)
    assert kq.form.bits == BITS[fmt]
    layout = invariant_q8_layout(weight.codes, weight.scales, weight.mins)
    x = rows(max(ROW_COUNTS), k, seed=7, extreme=extreme)
    torch.ops.argosy_iq.set_path("scalar")
    reference = torch.ops.argosy_iq.q8_linear(x, *layout, n, True, *code_range(weight.codes))
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(kq.linear(x[:count], n, True)), bits(reference[:count])), (path, count)
        alone = torch.cat([kq.linear(x[i : i + 1], n, True) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path
        rounded = kq.linear(x, n, False)
        assert torch.equal(bits(rounded), bits(reference.bfloat16())), path


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("fine", [False, True])
def test_the_swiglu_form_gives_swiglus_bits_on_the_outputs(paths: list[str], fmt: str, fine: bool) -> None:
    """kq_linear's swiglu form (a gate tile beside its up tile in the AMX kernel from 12 rows and
    the AVX-512 VNNI tiles from 16; else the whole output, then swiglu's work) gives the bits of
    argosy_iq.swiglu on the plain output, at every row count, on every path; 3 gate tiles (an odd
    count), and 150 rows of 8,192 inputs (passes of 128 rows)."""
    torch.ops.argosy_iq.set_path("auto")
    for n, k, counts in ((96, 512, [*ROW_COUNTS, 12, 15, 16, 17]), (32, 8192, [150])):
        weight, super_scales = kquant(fmt, n, k, seed=11 + fine)
        kq = packed(weight, super_scales)
        x = rows(max(counts), k, seed=5).float()
        for path in paths:
            torch.ops.argosy_iq.set_path(path)
            for count in counts:
                plain = kq.linear(x[:count], n, True, fine=fine)
                fused = kq.linear(x[:count], n, True, fine=fine, swiglu=True)
                assert fused.shape == (count, n // 2)
                assert torch.equal(bits(fused), bits(torch.ops.argosy_iq.swiglu(plain))), (path, n, count)


def test_the_swiglu_form_refuses_what_it_cannot_give() -> None:
    weight, super_scales = kquant("q4_k", 48, 256, seed=1)
    kq = packed(weight, super_scales)
    x = rows(20, 256, seed=2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kq.linear(x.float(), 48, True, swiglu=True)
    weight, super_scales = kquant("q4_k", 64, 256, seed=1)
    kq = packed(weight, super_scales)
    with pytest.raises(RuntimeError, match="float32"):
        kq.linear(x, 64, False, swiglu=True)  # bf16 in, bf16 out
    layer = packed_layer(weight, super_scales)
    assert layer.swiglu(x) is None  # x not float32: the two steps
    fused = layer.swiglu(x.float())
    assert fused is not None and torch.equal(bits(fused), bits(torch.ops.argosy_iq.swiglu(layer(x.float()))))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_a_bias_added_as_the_outputs_are_stored_gives_the_bits_of_adding_it_after(
    paths: list[str], fmt: str
) -> None:
    """kq_linear's add (a layer's bias, float32 outputs): on every path and row count (a decode
    step's few rows, the VNNI and AMX tiles' streamed stores, a row block's remainder), the bits
    of the output plus the bias; refused with the swiglu form or a bfloat16 output. A layer with
    a bias gives the same bits whichever way it adds it."""
    n, k = 96, 512
    weight, super_scales = kquant(fmt, n, k, seed=7)
    kq = packed(weight, super_scales)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8)) * 3
    x = rows(150, k, seed=9).float()
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in (1, 5, 12, 16, 33, 150):
            plain = kq.linear(x[:count], n, True)
            assert torch.equal(bits(kq.linear(x[:count], n, True, add=bias)), bits(plain + bias)), (
                path,
                count,
            )
    with pytest.raises(RuntimeError, match="float32 output"):
        kq.linear(x[:4].bfloat16(), n, False, add=bias)
    with pytest.raises(RuntimeError, match="float32 output"):
        kq.linear(x[:4], n, True, swiglu=True, add=bias)
    with pytest.raises(RuntimeError, match="float32 \\[out_features\\]"):
        kq.linear(x[:4], n, True, add=bias[:-1])
    layer = Int8Linear(None, bias, torch.float32, invariant=True, blocks=weight_blocks(weight, super_scales))
    torch.ops.argosy_iq.set_path("auto")
    assert torch.equal(bits(layer(x[:20])), bits(kq.linear(x[:20], n, True) + bias))


@pytest.mark.parametrize("fmt", FORMATS)
def test_planes_give_the_codes_and_the_values_back(fmt: str) -> None:
    n, k = 64, 256
    weight, super_scales = kquant(fmt, n, k, seed=3)
    kq = packed(weight, super_scales)
    ids = torch.tensor([0, 5, 17, 63, 16, 5])
    values = weight.codes.float().view(n, -1, weight.group) * weight.scales[..., None]
    if weight.mins is not None:
        values = values.view(n, -1, 32) + weight.mins[..., None]
    assert torch.equal(kq.values(ids), values.reshape(n, k)[ids])


def test_resident_bytes_are_the_files() -> None:
    """Bytes held per weight: Q4_K 4.625 bits (the file: 4.5), Q6_K 6.5625 (the file's own)."""
    n, k = 64, 1024

    def held(kq: PackedCodes) -> float:
        parts = [kq.nib, kq.high, kq.scales, kq.scale_d, kq.mins, kq.min_d]
        return 8 * sum(p.numel() * p.element_size() for p in parts if p is not None) / (n * k)

    assert held(packed(*kquant("q4_k", n, k, 1))) == 4.625
    assert held(packed(*kquant("q6_k", n, k, 1))) == 6.5625
    assert held(packed(*kquant("q5_0", n, k, 1))) == 5.5


def test_full_range_codes_and_float32_scales_stay_int8() -> None:
    n, k = 32, 256
    weight, _ = kquant("q5_1", n, k, seed=2)
    full = weight.codes.clone()
    full[0, 0], full[0, 1] = -127, 127
    assert PackedCodes.of(full, weight.scales, weight.mins, None, -127, 127) is None
    odd_scales = weight.scales + 1e-7  # not float16 values, no K-quant scales: the int8 form
    assert PackedCodes.of(weight.codes, odd_scales, weight.mins, None, *code_range(weight.codes)) is None


def test_a_layer_of_packed_codes_equals_the_int8_layer() -> None:
    n, k = 48, 512
    weight, super_scales = kquant("q4_k", n, k, seed=5)
    int8 = Int8Linear(None, None, torch.bfloat16, invariant=True, blocks=weight)
    kq = packed_layer(weight, super_scales)
    assert kq.packed is not None and int8.packed is None
    x = rows(6, k, seed=9)
    assert torch.equal(bits(kq(x)), bits(int8(x)))


def test_a_fused_layer_of_two_formats_holds_each_part_at_its_bits() -> None:
    """A Q4_K_M layer's q and k (Q4_K) and v (Q6_K): q and k stacked at 4 bits, v apart at 6,
    the outputs side by side, each the bits of its own weight alone."""
    from argosy.models.quantize import runs_of_one_form
    from argosy.ops.composite_linear import PartsLinear

    k = 512
    (q, q_super), (kk, k_super), (v, v_super) = (
        kquant(f, 32, k, seed=s) for f, s in [("q4_k", 1), ("q4_k", 2), ("q6_k", 3)]
    )
    parts = [
        BlockCodes(q.codes, q.scales, q.mins, q_super),
        BlockCodes(kk.codes, kk.scales, kk.mins, k_super),
        BlockCodes(v.codes, v.scales, v.mins, v_super),
    ]
    runs = runs_of_one_form(parts)
    assert [r.codes.shape[0] for r in runs] == [64, 32]
    layers = [Int8Linear(None, None, torch.bfloat16, invariant=True, blocks=r) for r in runs]
    assert [layer.packed.bits for layer in layers if layer.packed is not None] == [4, 6]
    fused = PartsLinear(list(layers))
    x = rows(5, k, seed=4)
    alone = [Int8Linear(None, None, torch.bfloat16, invariant=True, blocks=p)(x) for p in parts]
    assert torch.equal(bits(fused(x)), bits(torch.cat(alone, dim=-1)))


@pytest.mark.parametrize("fmt", ["q6_k", "q8_0"])
def test_a_layers_first_outputs_are_its_outputs_cut(fmt: str) -> None:
    """Int8Linear.first_outputs (a draft model's head cut to its first tokens): the same bits as
    the whole layer's first columns, at the file's bits (Q6_K) and as int8 codes (Q8_0's)."""
    n, k = 64, 512
    if fmt == "q8_0":
        gen = torch.Generator().manual_seed(5)
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        weight = BlockCodes(codes, (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().float())
    else:
        weight, super_scales = kquant(fmt, n, k, seed=4)
        weight = BlockCodes(weight.codes, weight.scales, weight.mins, super_scales=super_scales)
    layer = Int8Linear(None, None, torch.bfloat16, invariant=True, float_output=True, blocks=weight)
    assert (layer.packed is not None) == (fmt == "q6_k")
    part = layer.first_outputs(32)
    x = rows(5, k, seed=9)
    assert part.out_features == 32 and layer.out_features == n
    assert torch.equal(bits(part(x)), bits(layer(x)[:, :32]))
