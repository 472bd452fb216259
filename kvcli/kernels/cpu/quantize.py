"""q4_hadamard's scale search on the CPU in one compiled pass (numba): `quantize_vectors`' result
(kvcli/cache/hadamard.py) without its torch ops.

The torch path spends ~20 ops on a grid of candidate scales for every block at once, each with its fixed
cost and a (grid, blocks, 32) temporary: a window flush of four sequences (17 positions, K and V) took
~2.4 ms a layer (0.15 ms here). Here the blocks are searched side by side, each alone: the same
candidates, the same IEEE division and round-half-even, the refit's sums in element order (torch orders
its own way), so a block's codes can differ from torch's only where an f32 sum rounds across a bf16
boundary or two candidates' errors tie (tests/test_hadamard.py). A block's bits do not depend on what
else is in the call.

`put_vectors` writes q4_hadamard's codes and scales into the store's layout (kvcli/cache/hadamard.py) position by position: a
window flush is a few positions of each sequence, each at its own place, where the torch path unpacked,
edited and repacked whole key tiles (~60 us a flush and layer; ~25 us here, the calls' overhead included).
`put_dense` does the same for f32/f16/bf16 vectors (a dense store's decode tokens, the recent window's ring).
Both are the kernel table's WRITE entries (kvcli/attention.py); the stores' torch writes are their reference.
"""

from __future__ import annotations

import numpy as np
import torch

from .compile import RNE, available, exact_jit, jit
from .vectors import bf16_from_f32, from_f32, to_f32

__all__ = ["available", "put_dense", "put_vectors", "quantize"]

BLOCK = 32


@exact_jit
def _search(x, grid, u, d, xt, m, dd, num, den, err, best_err, best_d, best_s):
    """x (N, 32) f32 -> u (N, 32) uint8 codes 0..15 and d (N,) f32 (bf16 values): per block, the candidate
    scales m g / -8 (m: the signed value of largest magnitude, the first on ties; g over grid), each refit
    to sum(q x) / sum(q q) (sums in element order) and rounded to bf16; the one of least squared error (the
    first on ties). The blocks run side by side (the vectors' lanes), each alone.
    Scratch, separate arrays (no aliasing: the loops vectorize): xt (32, N) f32, x transposed; m, dd, num, den,
    err, best_err, best_d (N,) f32; best_s (N,) int64."""
    N, E = x.shape
    for b in range(N):
        for e in range(E):
            xt[e, b] = x[b, e]
    lo, hi = np.float32(-8), np.float32(7)
    m[:] = xt[0]
    for e in range(1, E):
        for b in range(N):
            if abs(xt[e, b]) > abs(m[b]):
                m[b] = xt[e, b]
    best_err[:] = np.inf
    for s in range(grid.shape[0]):
        for b in range(N):
            t = (m[b] * grid[s]) / np.float32(-8)
            dd[b] = np.float32(1) if t == 0 else t
            num[b] = 0
            den[b] = 0
        for e in range(E):
            for b in range(N):
                q = min(max((xt[e, b] / dd[b] + RNE) - RNE, lo), hi)
                num[b] += q * xt[e, b]
                den[b] += q * q
        for b in range(N):
            d[b] = to_f32(np.int16(bf16_from_f32(num[b] / max(den[b], np.float32(1e-30)))))  # this candidate's
            err[b] = 0
        for e in range(E):
            for b in range(N):
                q = min(max((xt[e, b] / dd[b] + RNE) - RNE, lo), hi)
                r = xt[e, b] - d[b] * q
                err[b] += r * r
        for b in range(N):
            if s == 0 or err[b] < best_err[b]:  # the first on ties (and where every error overflows, as argmin)
                best_err[b], best_d[b], best_s[b] = err[b], d[b], s
    for b in range(N):
        t = (m[b] * grid[best_s[b]]) / np.float32(-8)
        dd[b] = np.float32(1) if t == 0 else t
        d[b] = best_d[b]
    for b in range(N):
        for e in range(E):
            u[b, e] = np.uint8(min(max((xt[e, b] / dd[b] + RNE) - RNE, lo), hi) + np.float32(8))


def quantize(y: torch.Tensor, grid: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, T, H, D) f32 on the CPU -> codes (B, T, H, D) uint8, scales (B, T, H, D / 32) f32, as
    quantize_vectors with the scale grid `grid` (f32)."""
    B, T, H, D = y.shape
    x = y.detach().reshape(-1, BLOCK).float().contiguous().numpy()
    N = x.shape[0]
    u, d = np.empty((N, BLOCK), np.uint8), np.empty(N, np.float32)
    _search(x, grid, u, d, np.empty((BLOCK, N), np.float32), *(np.empty(N, np.float32) for _ in range(7)),
            np.empty(N, np.int64))
    return torch.from_numpy(u).view(B, T, H, D), torch.from_numpy(d).view(B, T, H, D // BLOCK)


@exact_jit
def _q8_0_blocks(y, out):
    """y (B, T, H, D) f32 -> out (B, H, T, D / 32 * 34) uint8, ggml's quantize_row_q8_0_ref: d = amax / 127 (its f16
    bits first, rounded to nearest even), then roundf(x / d) as int8 (x times 1 / d, halves away from zero)."""
    B, T, H, D = y.shape
    for b in range(B):
        for t in range(T):
            for h in range(H):
                for k in range(D // 32):
                    amax = np.float32(0)
                    for e in range(32):
                        amax = max(amax, abs(y[b, t, h, 32 * k + e]))
                    d = amax / np.float32(127)
                    inv = np.float32(1) / d if d != 0 else np.float32(0)
                    bits = from_f32(d, np.uint16(0))
                    o = 34 * k
                    out[b, h, t, o] = np.uint8(bits & 0xFF)
                    out[b, h, t, o + 1] = np.uint8(bits >> 8)
                    for e in range(32):
                        v = y[b, t, h, 32 * k + e] * inv
                        q = np.int32(v) + np.int32(np.float32(2) * (v - np.float32(np.int32(v))))  # roundf
                        out[b, h, t, o + 2 + e] = np.uint8(q & 0xFF)


def q8_0_blocks(y: torch.Tensor) -> torch.Tensor:
    """y (B, T, H, D) f32 -> q8_0 blocks (B, H, T, D / 32 * 34) uint8, as Q8_0Store.quantize_reference lays them."""
    B, T, H, D = y.shape
    out = np.empty((B, H, T, D // 32 * 34), np.uint8)
    _q8_0_blocks(y.float().numpy(), out)
    return torch.from_numpy(out)


@jit
def _put_vectors(data, scale, u, d, rows, pos, keys):
    """Entry m's codes u[m] (H, D) uint8 and scales d[m] (H, D / 32) f32 (bf16 values) -> sequence rows[m] at position
    pos[m] of a layer's data, keys (B, H, n_pad / T, D, T / 2) or values (B, H, D / W, n_pad, W / 2), uint8, and
    scale (B, H, D / 32, n_pad), bf16 bits (int16); keys: which layout data is."""
    M, H, D = u.shape
    for m in range(M):
        b, p = rows[m], pos[m]
        if not (0 <= b < scale.shape[0] and 0 <= p < scale.shape[3]):  # no bounds checks in compiled code
            raise IndexError("a q4_hadamard write outside its store")
        for h in range(H):
            for k in range(D // 32):
                scale[b, h, k, p] = np.int16(bf16_from_f32(d[m, h, k]))
            if keys:  # byte (p // T, e, p % (T / 2)): its high nibble for the tile's second half
                T2 = data.shape[4]
                i, j = p // (2 * T2), p % T2
                col = data[b, h, i]
                if p % (2 * T2) >= T2:
                    for e in range(D):
                        col[e, j] = (col[e, j] & np.uint8(0x0F)) | (u[m, h, e] << np.uint8(4))
                else:
                    for e in range(D):
                        col[e, j] = (col[e, j] & np.uint8(0xF0)) | u[m, h, e]
            else:  # bytes (i, p, j): elements W i + j (low nibble) and W i + W / 2 + j (high)
                W2 = data.shape[4]
                for i in range(data.shape[2]):
                    for j in range(W2):
                        e = 2 * W2 * i + j
                        data[b, h, i, p, j] = u[m, h, e] | (u[m, h, e + W2] << np.uint8(4))


def put_vectors(data: np.ndarray, scale: np.ndarray, u: torch.Tensor, d: torch.Tensor, rows: np.ndarray, pos: np.ndarray,
        keys: bool) -> None:
    """u (M, H, D) uint8 codes, d (M, H, D / 32) f32 scales of M vectors, vector m to sequence rows[m] at position
    pos[m] (int64 arrays) of a layer's data and scale arrays (the store's own bytes: numpy views)."""
    _put_vectors(data, scale, u.contiguous().numpy(), d.float().contiguous().numpy(), rows, pos, keys)


# ---- dense writes: f32 vectors rounded to a dense layer's elements (f16, bf16 bits, f32) in place ----
@jit
def _put_dense(data, new, data2, new2, rows, pos):
    """new (M, H, D) f32 -> data (B, H, n, D) at sequence rows[m], position pos[m], and new2 -> data2 likewise (a K and
    V pair in one pass; data2 is data and new2 new for a single write): the bits torch's conversion gives."""
    M, H, D = new.shape
    for m in range(M):
        b, p = rows[m], pos[m]
        if not (0 <= b < data.shape[0] and 0 <= p < data.shape[2] and b < data2.shape[0] and p < data2.shape[2]):
            raise IndexError("a dense write outside its store")  # no bounds checks in compiled code
        for h in range(H):
            for e in range(D):
                data[b, h, p, e] = from_f32(new[m, h, e], data[b, h, p, e])
                data2[b, h, p, e] = from_f32(new2[m, h, e], data2[b, h, p, e])


def put_dense(arrays: tuple, values: tuple, rows: np.ndarray, pos: np.ndarray) -> None:
    """values[i] (M, H, D) f32 (any strides) -> arrays[i] (B, H, n, D: f32, f16 bits as uint16, bf16 bits as int16),
    one array or a K and V pair of the same dtype, vector m at sequence rows[m], position pos[m] (int64 arrays), in
    one compiled pass: torch's rounding without its dozen ops."""
    new = [v.numpy() for v in values]
    _put_dense(arrays[0], new[0], arrays[-1], new[-1], rows, pos)
