"""Decode products straight from packed weights: y = x @ W.T for a few rows of x, W never dequantized
to memory (a decode step reads each weight once, so its speed is the bytes read).

W (N, K) is kept in blocks of 32 along K, as ggml orders them:
  BITS 4: codes (N, K / 2) uint8, byte 16 b + j of a row holding element 32 b + j in its low nibble
          and 32 b + 16 + j in its high one (Q4_0's qs); W = q * scale + min, q 0..15;
  BITS 8: codes (N, K) int8; W = q * scale (Q8_0);
scale and min (N, K / 32), any float dtype (f16 as the forms keep them). A program owns BLOCK_N
outputs and all M <= BLOCK_M rows: each (BLOCK_N, BLOCK_K) tile of W is decoded once in registers
and multiplied into every row, in f32. A tile is read as pairs (element e, e + 16), the low and
high nibbles of one byte, so both bit widths share the arithmetic.

This module imports nothing from kvcli. Reference: the form's dequantize() then x @ W.T in f32
(kvcli.weights.Blocks, whose PRODUCT entry on CUDA launches this up to KERNEL_ROWS rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # elements per scale along K (one ggml block)


@triton.jit
def _weight_matmul_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                          BITS: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:M, n-block] = x[:M] @ W[n-block].T; x (M, K) f32, y (M, N) f32, both rows contiguous."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    row_n = offs_n.to(tl.int64)[:, None]  # 64-bit: N * K bytes can pass 2^31 (a 128k-vocab head)
    rows = tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_K // 2)  # the pair (byte) within a tile
    e = (j // 16) * GROUP + j % 16  # its low element; the high one is e + 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lo = k0 + e
        kmask = lo < K  # K is whole blocks of 32: a pair is in or out with its block
        mask = nmask[:, None] & kmask[None, :]
        if BITS == 4:
            b = tl.load(q_ptr + row_n * (K // 2) + (k0 // 2 + j)[None, :], mask=mask, other=0).to(tl.int32)
            q_lo = (b & 15).to(tl.float32)
            q_hi = (b >> 4).to(tl.float32)
        else:
            at = q_ptr + row_n * K + lo[None, :]
            q_lo = tl.load(at, mask=mask, other=0).to(tl.float32)
            q_hi = tl.load(at + 16, mask=mask, other=0).to(tl.float32)
        sm = row_n * (K // GROUP) + (lo // GROUP)[None, :]
        s = tl.load(s_ptr + sm, mask=mask, other=0.0).to(tl.float32)
        w_lo = q_lo * s
        w_hi = q_hi * s
        if HAS_MIN:
            mn = tl.load(m_ptr + sm, mask=mask, other=0.0).to(tl.float32)
            w_lo += mn
            w_hi += mn
        for r in tl.static_range(BLOCK_M):  # each row against the decoded tile; row r's sums into acc[r]
            xmask = kmask & (tl.full((BLOCK_K // 2,), r, tl.int32) < M)  # a vector: the interpreter takes no scalar
            x_lo = tl.load(x_ptr + r * stride_xm + lo, mask=xmask, other=0.0)
            x_hi = tl.load(x_ptr + r * stride_xm + lo + 16, mask=xmask, other=0.0)
            p = tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], 1)  # (BLOCK_N,)
            acc = tl.where(rows[:, None] == r, acc + p[None, :], acc)
    ymask = (rows[:, None] < M) & nmask[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc, mask=ymask)


def weight_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor | None,
                  bits: int, block_n: int = 16, block_k: int = 256, num_warps: int = 4) -> torch.Tensor:
    """x (M, K) f32 @ W.T -> (M, N) f32 for W in the layout above (min_ None: no min, Q8_0).
    M is small (a decode step's rows: each row is a pass over the decoded tile)."""
    M, K = x.shape
    N = codes.shape[0]
    assert bits in (4, 8) and K % GROUP == 0 and codes.shape[1] == K * bits // 8, (bits, K, codes.shape)
    assert block_k >= GROUP and block_k & (block_k - 1) == 0, block_k  # whole blocks, a power of two
    assert scale.shape == (N, K // GROUP) and codes.is_contiguous() and scale.is_contiguous()
    x = x.float().contiguous()
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n),)
    _weight_matmul_kernel[grid](x, codes, scale, scale if min_ is None else min_, y, M, N, K, x.stride(0), y.stride(0),
                                BITS=bits, HAS_MIN=min_ is not None, BLOCK_M=max(triton.next_power_of_2(M), 1),
                                BLOCK_N=block_n, BLOCK_K=min(block_k, max(GROUP, triton.next_power_of_2(K))),
                                num_warps=num_warps)
    return y
