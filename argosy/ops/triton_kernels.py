"""Triton kernels of the CUDA path: paged attention, the matmuls (float and GGUF Q4 blocks) and
RMSNorm, each computing an output row in an order fixed by the shapes of the weights alone.

Why own kernels and not cuBLAS / SDPA: the same request must give the same tokens whatever
runs beside it (SPEC: deterministic by default). cuBLAS chooses its algorithm (tile shape,
split-K) by the number of rows, and torch's row reductions split a row across threads by
how many rows there are; either changes the rounding of one row when the batch changes.
Here every output tile has fixed sizes (BLOCK_M rows, whatever M is), the K loop runs in
one order, and no reduction is ever split: a row's result depends on its own inputs only.
Attention is one program per (token row, KV head), walking that row's blocks in order with
an online softmax: decode rows and prefill tokens (each a row over its own context) take the
same code, so a prefix-cache hit computes what a cold prefill computes.

Runs on CUDA; with TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU
tensors through Triton's interpreter, which is how the CPU test suite checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 32  # a GGUF Q4 block: weights per scale and minimum
BLOCK_M = 16  # rows of an output tile (tl.dot needs 16); never chosen by M
BLOCK_N = 64
BLOCK_K = 32  # one Q4 block along K per step of the loop
ATTENTION_TILE = 16  # positions per step of attention's online softmax (any KV block size)
NO_WINDOW = 1 << 62  # a "window" longer than any context (one code path, no branch in the kernel)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_table,
    stride_ot,
    stride_oh,
    scale,
    window,
    block_size,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    TILE: tl.constexpr,
):
    """One (row, KV head): the row's GROUP query heads over positions [start, length) of its
    sequence, TILE positions at a time from position 0's tile on, whatever the KV block size
    (each position's slot is looked up through the block table), so neither the batch, the
    chunking nor the cache's block size changes the order of the sums."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + row)
    start = tl.maximum(length - window, 0)  # no window: `window` is past any length
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale
    best = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    offsets = tl.arange(0, TILE)
    for t in range(start // TILE, tl.cdiv(length, TILE)):
        position = t * TILE + offsets
        valid = (position < length) & (position >= start)
        block = tl.load(tables_ptr + row * stride_table + position // block_size, mask=valid, other=0)
        slots = block.to(tl.int64) * block_size + position % block_size
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        where = slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + where, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp(scores - new_best[:, None])
        alpha = tl.exp(best - new_best)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + where, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    out_where = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_where, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D]: each row attends over positions [max(0, len - window), len) of its own
    sequence, read through its block table. k_cache, v_cache [slots, KVH, D]; tables [T, B]
    (block ids); lens [T]. Returns [T, H, D] in q's dtype."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    _paged_attention_kernel[(rows, kv_heads)](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        window or NO_WINDOW,
        block_size,
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        HEAD_DIM=dim,
        HEAD_DIM_P=triton.next_power_of_2(dim),
        TILE=ATTENTION_TILE,
    )
    return out


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """y = x @ w.T, x [M, K], w [N, K]: fixed tiles, one K order, float32 accumulation."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + k[None, :],
            mask=(cols[:, None] < N) & (k[None, :] < K),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    where = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(where, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _q4_matmul_kernel(
    x_ptr,
    codes_ptr,
    d_ptr,
    m_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_codes,
    stride_groups,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """y = x @ w.T where w[n, k] = d[n, k / 32] * code[n, k] + m[n, k / 32], the codes two to a
    byte (even k in the low nibble), as a GGUF Q4_0/Q4_1 block holds them; each block is
    unpacked in registers, never written out."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, 32)
    half = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    col_ok = cols < N
    for group in range(0, K // 32):
        k = group * 32 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=rows[:, None] < M, other=0.0)
        packed = tl.load(
            codes_ptr + cols[:, None] * stride_codes + group * 16 + half[None, :],
            mask=col_ok[:, None],
            other=0,
        )
        codes = tl.join(packed & 0x0F, packed >> 4).reshape(BLOCK_N, 32).to(tl.float32)
        scale = tl.load(d_ptr + cols * stride_groups + group, mask=col_ok, other=0.0).to(tl.float32)
        low = tl.load(m_ptr + cols * stride_groups + group, mask=col_ok, other=0.0).to(tl.float32)
        w = (codes * scale[:, None] + low[:, None]).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    where = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(where, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & col_ok[None, :])


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T in x's dtype, each row computed alike whatever M is."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        ieee = x.dtype == torch.float32
        _matmul_kernel[_grid(m, n)](
            x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), BLOCK_M, BLOCK_N, BLOCK_K, ieee
        )
    return y


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the Q4 weight [N, K].T: codes uint8 [N, K/2], d and mins [N, K/32]."""
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    if k % GROUP_SIZE:
        raise ValueError(f"a Q4 weight's K must be a multiple of {GROUP_SIZE}, got {k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        ieee = x.dtype == torch.float32
        _q4_matmul_kernel[_grid(m, n)](
            x,
            codes,
            d,
            mins,
            y,
            m,
            n,
            k,
            x.stride(0),
            codes.stride(0),
            d.stride(0),
            y.stride(0),
            BLOCK_M,
            BLOCK_N,
            ieee,
        )
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    stride_x,
    stride_y,
    eps,
    BLOCK: tl.constexpr,
    GEMMA: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, axis=0) / N
    h = x * (1.0 / tl.sqrt(mean + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if GEMMA:  # (h * (1 + w)) in float32, then the input's dtype
        y = (h * (1.0 + w.to(tl.float32))).to(y_ptr.dtype.element_ty)
    else:  # w * h.to(dtype), as transformers' LlamaRMSNorm
        y = (w.to(tl.float32) * h.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row (never a split reduction)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        n = shape[-1]
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, y, n, x2.stride(0), y.stride(0), eps, BLOCK=triton.next_power_of_2(n), GEMMA=gemma
        )
    return y.view(shape)
