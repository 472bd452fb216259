"""Decode attention over the hidden-state cache: K and V are rebuilt in registers, never stored.

A program owns one (batch, KV head) and one split of the key positions (flash-decoding). For
each tile of BLOCK_N positions it streams the stored x (BLOCK_N x n_embd, BLOCK_E columns at
a time) and multiplies it with the head's rows of Wk and Wv (`tl.dot`): K's even and odd
rows separately, so RoPE's adjacent pairs (2i, 2i+1) (GGUF llama layout) rotate in registers
with the cos/sin of the tile's positions; scores are q_even . k_even' + q_odd . k_odd'. The
online softmax (base 2) folds in P @ V, and `kernels.attention`'s split-reduce kernel merges
the splits. Only T = 1 and dense x (f32, f16, bf16) run here (kvcli.attention decides);
block-quantized and q4_hadamard x, prefill and -fa off use the PyTorch path, the kernel's
reference: `kvcli.attention.attend_reference` over the hidden cache's rebuilt K/V.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import LOG2E, _split_reduce_kernel


@triton.jit
def _hidden_decode_kernel(qe_ptr, qo_ptr, sq_b, sq_h, sq_r,
                          x_ptr, sx_b, sx_h, sx_n, w_ptr, sw, cos_ptr, sin_ptr, s_rot,
                          o_ptr, ml_ptr, Hkv, M, n_keys, split_len, S, E, KV_DIM,
                          D: tl.constexpr, D2: tl.constexpr, DS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, W_F32: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    rmask = r < M
    i2 = tl.arange(0, D2)
    d = tl.arange(0, D)
    q_off = b * sq_b + h * sq_h + r[:, None] * sq_r + i2[None, :]
    qe = tl.load(qe_ptr + q_off, mask=rmask[:, None], other=0.0)  # (BLOCK_M, D2), pre-scaled
    qo = tl.load(qo_ptr + q_off, mask=rmask[:, None], other=0.0)
    # Wk rows h*D + 2i (even) and + 2i + 1 (odd), Wv rows KV_DIM + h*D + d, as (BLOCK_E, cols) tiles
    wke_rows = (h * D + 2 * i2) * sw
    wko_rows = wke_rows + sw
    wv_rows = (KV_DIM + h * D + d) * sw
    start = pid_s * split_len
    end = tl.minimum(start + split_len, n_keys)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    x_base = x_ptr + b * sx_b
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        ke = tl.zeros([BLOCK_N, D2], tl.float32)
        ko = tl.zeros([BLOCK_N, D2], tl.float32)
        v = tl.zeros([BLOCK_N, D], tl.float32)
        for e0 in tl.range(0, E, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            emask = e < E
            # stored x is (Hs, n_ctx, DS) per sequence: element e of position n at (e // DS, n, e % DS)
            x = tl.load(x_base + (e // DS)[None, :] * sx_h + offs_n.to(tl.int64)[:, None] * sx_n + (e % DS)[None, :],
                        mask=nmask[:, None] & emask[None, :], other=0.0)  # (BLOCK_N, BLOCK_E)
            wke = tl.load(w_ptr + wke_rows[None, :] + e[:, None], mask=emask[:, None], other=0.0)  # (BLOCK_E, D2)
            wko = tl.load(w_ptr + wko_rows[None, :] + e[:, None], mask=emask[:, None], other=0.0)
            wv = tl.load(w_ptr + wv_rows[None, :] + e[:, None], mask=emask[:, None], other=0.0)  # (BLOCK_E, D)
            xw = x.to(wv.dtype)  # multiply in the weights' dtype (f16/bf16: tensor cores, f32 accumulators)
            if W_F32:  # f32 weights: full-precision products, not tf32
                ke = tl.dot(xw, wke, ke, input_precision="ieee")
                ko = tl.dot(xw, wko, ko, input_precision="ieee")
                v = tl.dot(xw, wv, v, input_precision="ieee")
            else:
                ke = tl.dot(xw, wke, ke)
                ko = tl.dot(xw, wko, ko)
                v = tl.dot(xw, wv, v)
        rot_off = offs_n[:, None] * s_rot + i2[None, :]
        c = tl.load(cos_ptr + rot_off, mask=nmask[:, None], other=0.0)
        s_ = tl.load(sin_ptr + rot_off, mask=nmask[:, None], other=0.0)
        kre = ke * c - ko * s_  # (a + ib)(cos + i sin), pairs (2i, 2i + 1)
        kro = ke * s_ + ko * c
        s = tl.dot(qe, tl.trans(kre), input_precision="ieee") + tl.dot(qo, tl.trans(kro), input_precision="ieee")
        s = tl.where(nmask[None, :], s, float("-inf"))  # decode: every stored position is visible
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    # o: (B, Hkv, S, M, D) contiguous; ml: (B, Hkv, S, M, 2) = (max, sum) of each split
    row = (pid_bh * S + pid_s).to(tl.int64) * M + r
    tl.store(o_ptr + row[:, None] * D + d[None, :], out, mask=rmask[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=rmask)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=rmask)


def attend_hidden_kernel(q: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         pos: int, num_splits: int | None = None, block_n: int = 32, block_e: int = 64) -> torch.Tensor:
    """q (B, 1, Hq, D) f32 at position pos -> (B, 1, Hq * D) f32 over positions 0..pos of one layer.

    x (B, Hs, n_ctx, Ds): the stored normed inputs, dense; w (2 * kv_dim, n_embd): the layer's K rows
    then V rows (GGUF adjacent-pair RoPE layout); cos, sin (n_ctx, D / 2) f32: the RoPE table.
    Runs wherever triton runs (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    B, T, H, D = q.shape
    n_embd, kv_dim = w.shape[1], w.shape[0] // 2
    Hkv = kv_dim // D
    G = H // Hkv
    M = T * G
    assert w.stride(1) == 1 and T == 1
    qg = q.float().reshape(B, Hkv, G, D) * (LOG2E / math.sqrt(D))  # T = 1: rows are the group's heads
    qe, qo = qg[..., 0::2].contiguous(), qg[..., 1::2].contiguous()
    n_keys = pos + 1
    n_blocks = triton.cdiv(n_keys, block_n)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = triton.cdiv(2 * sms, B * Hkv)
    num_splits = max(1, min(num_splits, n_blocks))
    split_len = triton.cdiv(triton.cdiv(n_keys, num_splits), block_n) * block_n
    S = triton.cdiv(n_keys, split_len)
    o = torch.empty(B, Hkv, S, M, D, device=q.device, dtype=torch.float32)
    ml = torch.empty(B, Hkv, S, M, 2, device=q.device, dtype=torch.float32)
    _hidden_decode_kernel[(B * Hkv, S)](
        qe, qo, qe.stride(0), qe.stride(1), qe.stride(2),
        x, x.stride(0), x.stride(1), x.stride(2), w, w.stride(0), cos, sin, cos.stride(0),
        o, ml, Hkv, M, n_keys, split_len, S, n_embd, kv_dim,
        D=D, D2=D // 2, DS=x.shape[-1], BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
        BLOCK_E=block_e, W_F32=w.dtype == torch.float32, num_warps=4)
    if S == 1:
        out = o[:, :, 0]
    else:
        out = torch.empty(B, Hkv, M, D, device=q.device, dtype=torch.float32)
        _split_reduce_kernel[(B * Hkv, M)](o, ml, out, M, S, SP=triton.next_power_of_2(S), DP=D)
    return out.reshape(B, 1, H * D)  # rows g of KV head h are query heads h * G + g
