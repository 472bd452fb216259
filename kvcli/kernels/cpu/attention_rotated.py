"""q4_hadamard decode attention on the CPU in one compiled pass (numba): the CPU's counterpart of
the Triton kernel, for one query token per sequence (`kvcli run`, the server's slots).

What it computes is attend_reference's result (kvcli/attention.py) for T = 1 over a q4_hadamard K
and V store (kvcli/cache/hadamard.py) and their recent window: for each sequence b, KV head h and
query head g of its group,
    s_t = q_rot . (d_t,blk (u_t - 8)) + q_rot . c_k   store position t < lim[b] past the sinks,
    s_t = q_rot . sink_t                              a sink (its rotated f16 copy),
    s_n = q . k_n                                     window slot n, unless masked[b, n],
one softmax over all of them, then the store's values summed in the rotated space (d (u - 8) + c_v,
or the sink) and the window's in the model's; the first rotated back and the two added.
Torch would spend ~100 ops a layer on this (unpacking, products, offsets, sinks, the window's part, the
softmax's cat and split), each with its fixed cost; here it is one call that reads the codes where
they lie (no dequantized copy). The products over the codes are LLVM vector code (vectors.py: nibble_key_scores, nibble_value_sums):
16 bytes of codes widened once for up to 4 query heads, their sums kept in registers over a block's 32
dimensions (keys) or over the positions (values); numba's own loops at these short strides kept the sums
in memory and ran several times slower (benchmarks/README.md).

Each (sequence, head) is computed alone, in the same order whatever else is in the batch, so a
sequence gets the same bits alone and beside others (the server's solo/concurrent equality).
Single-threaded and without the GIL; it reads a store at any depth (it beat the int4 GEMM path, threaded or
not, at every depth measured). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .attention import no_extra
from .compile import VEC, available, jit, jit_reassociating, numba
from .vectors import (butterfly16, exp_f32, hadamard16, nibble_key_scores1, nibble_key_scores2, nibble_key_scores3,
                      nibble_key_scores4, nibble_value_sums1, nibble_value_sums2, nibble_value_sums3, nibble_value_sums4,
                      to_f32)



CHUNK_BYTES = VEC  # code bytes a vector step reads (vectors.py's nibble products): 16 positions (keys) or 32 elements (values)


@jit
def _walsh_hadamard(x):
    """x (D,) f32, D a power of two >= 16 <- H x in place (Sylvester's H, unnormalised): butterflies at distances 16,
    32, .. over whole vectors, the four shorter ones inside each 16 (cpu_jit.hadamard16)."""
    D = x.shape[0]
    for i in range(0, D, 16):
        hadamard16(x, i)
    d = 16
    while d < D:
        for i in range(0, D, 2 * d):
            for j in range(i, i + d, 16):
                butterfly16(x, j, d)
        d *= 2


@jit_reassociating
def _attend(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, extra, lim, out):
    """qm (B, H, G, D) f32: the query in the model's space, its scores scaled by `scale`; sgn (D,) f32: the first
    row of the rotation R = H diag(s) / sqrt(D) (hadamard.rotation), s / sqrt(D), so that R x = H (sgn x) and
    R^T y = sgn (H y); kdat (B, H, n_pad / T, D, T / 2) uint8 key tiles, vdat (B, H, D / W, n_pad, W / 2) value
    tiles, ksc/vsc (B, H, D / 32, n_pad) int16 (bf16 bits); ksink/vsink (B, H, S, D) rotated sinks, f16 bits
    (uint16); koff/voff (B, H, D) f32 offsets; wkv (B, 2 H, N, D) f16 bits, the window's slots (K's heads, then
    V's), wmask (B, N) bool (True: not read); extra (B, H, G, P) f32: added to the store's scores (P = 0: nothing,
    else P >= max lim: keys stored less their bias); lim (B,) int64: store positions 0..lim[b]-1 are read.
    -> out (B, H, G, D) f32 in the model's space. The rotations are done here, row by row (fast Walsh-Hadamard
    transforms, D log D additions where a product with R took D^2 multiply-adds), so that a row's bits do not depend
    on how many others share the call (a batched matmul's blocking does)."""
    B, H, G, D = qm.shape
    T2 = kdat.shape[4]
    T = 2 * T2
    NV, W2 = vdat.shape[2], vdat.shape[4]
    W = 2 * W2
    NB = D // 32
    S = ksink.shape[2]
    N = wkv.shape[2]
    n_max = 0
    for b in range(B):
        n_max = max(n_max, lim[b])
    s = np.empty((G, N + n_max + T), np.float32)  # scores: window slots, then store positions (whole tiles)
    qsum = np.empty((G, NB), np.float32)
    qoff = np.empty(G, np.float32)
    qs = np.empty((G, D), np.float32)  # the scaled query
    qb = np.empty((G, D), np.float32)  # ... rotated into the stores' space
    sink = np.empty((S, D), np.float32)  # a head's sinks (keys, then values) widened
    acc = np.empty((G, D), np.float32)
    accw = np.empty((G, D), np.float32)
    win = np.empty((N, D), np.float32)  # a head's window keys, then values, widened
    psum = np.empty(G, np.float32)
    for b in range(B):
        n = lim[b]
        m0 = min(S, n)  # sinks among the read positions
        nt = (n + T - 1) // T
        for h in range(H):
            for g in range(G):  # qb = R q
                for e in range(D):
                    qs[g, e] = qm[b, h, g, e] * scale
                    qb[g, e] = qs[g, e] * sgn[e]
                _walsh_hadamard(qb[g])
            # ---- scores ----
            for w in range(N):
                for e in range(D):
                    win[w, e] = to_f32(wkv[b, h, w, e])
            for g in range(G):
                for w in range(N):
                    if wmask[b, w]:
                        s[g, w] = -np.inf
                    else:
                        a = np.float32(0)
                        for e in range(D):
                            a += qs[g, e] * win[w, e]
                        s[g, w] = a
                a = np.float32(0)
                for e in range(D):
                    a += qb[g, e] * koff[b, h, e]
                qoff[g] = a
                for k in range(NB):
                    a = np.float32(0)
                    for e in range(32 * k, 32 * k + 32):
                        a += qb[g, e]
                    qsum[g, k] = a
            for g in range(G):
                for j in range(N, N + T * nt):
                    s[g, j] = qoff[g]
            for i in range(nt):  # key tile i: positions T i .. T i + T - 1
                kt = kdat[b, h, i]  # (D, T / 2)
                col = np.int64(N + T * i)
                for k in range(NB):
                    dk = ksc[b, h, k, T * i : T * i + T]
                    for c in range(T2 // CHUNK_BYTES):
                        g0 = 0
                        while g0 < G:  # a group of query heads at a time
                            r = G - g0
                            if r >= 4:
                                nibble_key_scores4(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            elif r == 3:
                                nibble_key_scores3(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            elif r == 2:
                                nibble_key_scores2(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            else:
                                nibble_key_scores1(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            g0 += min(r, 4)
            for t in range(m0):  # the sinks: their f16 copies, no offset
                for e in range(D):
                    sink[t, e] = to_f32(ksink[b, h, t, e])
            for g in range(G):
                for t in range(m0):
                    a = np.float32(0)
                    for e in range(D):
                        a += qb[g, e] * sink[t, e]
                    s[g, N + t] = a
            if extra.shape[3] > 0:  # q . R(p) b of keys stored less their bias
                for g in range(G):
                    for t in range(n):
                        s[g, N + t] += extra[b, h, g, t]
            # ---- softmax (unnormalised; divided at the end) ----
            for g in range(G):
                mx = np.float32(-np.inf)
                for j in range(N + n):
                    mx = max(mx, s[g, j])
                for j in range(N + n):
                    s[g, j] = exp_f32(s[g, j] - mx)
                a = np.float32(0)
                for j in range(N + n):
                    a += s[g, j]
                psum[g] = a
            # ---- weighted sums ----
            accw[:, :] = 0
            acc[:, :] = 0
            for w in range(N):
                for e in range(D):
                    win[w, e] = to_f32(wkv[b, H + h, w, e])
            for g in range(G):
                for w in range(N):
                    p = s[g, w]
                    if p != 0:
                        for e in range(D):
                            accw[g, e] += p * win[w, e]
            for i in range(NV):
                vt = vdat[b, h, i]  # (n_pad, W / 2)
                # elements W i + j and W i + W / 2 + j: their blocks' scales
                dlo, dhi = vsc[b, h, (W * i) // 32], vsc[b, h, (W * i + W2) // 32]
                for c in range(W2 // CHUNK_BYTES):
                    g0 = 0
                    while g0 < G:
                        r = G - g0
                        if r >= 4:
                            nibble_value_sums4(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        elif r == 3:
                            nibble_value_sums3(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        elif r == 2:
                            nibble_value_sums2(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        else:
                            nibble_value_sums1(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        g0 += min(r, 4)
            for t in range(m0):
                for e in range(D):
                    sink[t, e] = to_f32(vsink[b, h, t, e])
            for g in range(G):
                past = np.float32(0)  # the weight past the sinks carries the offset
                for j in range(N + m0, N + n):
                    past += s[g, j]
                for t in range(m0):
                    p = s[g, N + t]
                    for e in range(D):
                        acc[g, e] += p * sink[t, e]
                for e in range(D):
                    acc[g, e] += past * voff[b, h, e]
                inv = np.float32(1) / psum[g]
                _walsh_hadamard(acc[g])  # back from the rotated space: x = R^T x_rot
                for e in range(D):
                    out[b, h, g, e] = (accw[g, e] + acc[g, e] * sgn[e]) * inv


def attend(q: torch.Tensor, k, v, lim: np.ndarray, window, extra: np.ndarray | None = None) -> torch.Tensor:
    """kvcli/kernels/layout.py's decode signature: q (B, Hkv, G, D) f32 in the model's space, k and v Operands of a
    q4_hadamard K and V store layer (codes, bf16 scales, f16 sinks, f32 offsets; R's first row), lim (B,) int64,
    window a DecodeWindow or None -> (B, Hkv, G, D) f32 in the model's space."""
    B, H, G, D = q.shape
    kv, masked = (np.zeros((B, 2 * H, 0, D), np.uint16), np.zeros((B, 0), np.bool_)) if window is None else window
    out = np.empty((B, H, G, D), np.float32)
    kd, ks, ksink, ko = k.arrays
    vd, vs, vsink, vo = v.arrays
    _attend(q.contiguous().numpy(), np.float32(1 / math.sqrt(D)), k.signs, kd, ks, ksink, ko, vd, vs, vsink, vo, kv,
            masked, no_extra(q) if extra is None else np.ascontiguousarray(extra), lim, out)
    return torch.from_numpy(out)


def warm_up(k_layout=None, v_layout=None) -> None:
    """Load the kernel now (from numba's cache: ~0.3 s; compiled the first time: seconds), with the load,
    not in the first token's time. Tiny arrays of the same types as `attend` passes."""
    if numba is None:
        return
    f32 = np.float32
    z4, z5 = np.zeros((1, 1, 1, 32), f32), np.zeros((1, 1, 1, 32, 16), np.uint8)
    sinks, scales = np.zeros((1, 1, 1, 32), np.uint16), np.zeros((1, 1, 1, 32), np.int16)
    _attend(z4, f32(1), np.ones(32, f32), z5, scales, sinks, np.zeros((1, 1, 32), f32), z5.copy(), scales, sinks,
            np.zeros((1, 1, 32), f32), np.zeros((1, 2, 1, 32), np.uint16), np.zeros((1, 1), np.bool_),
            np.zeros((1, 1, 1, 0), f32), np.ones(1, np.int64), np.empty_like(z4))
