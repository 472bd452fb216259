"""q4_hadamard's scale search on the CPU in one compiled pass (numba): `quantize_vectors`' result
(kvcli/cache/hadamard.py) without its torch ops.

The torch path spends ~20 ops on a grid of candidate scales for every block at once, each with its fixed
cost and a (grid, blocks, 32) temporary: a window flush of four sequences (17 positions, K and V) took
~2.4 ms a layer (0.15 ms here). Here the blocks are searched side by side, each alone: the same
candidates, the same IEEE division and round-half-even, the refit's sums in element order (torch orders
its own way), so a block's codes can differ from torch's only where an f32 sum rounds across a bf16
boundary or two candidates' errors tie (tests/test_hadamard.py). A block's bits do not depend on what
else is in the call.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcli.cache.cpu_jit import RNE, available, bf16_from_f32, exact_jit, to_f32

__all__ = ["available", "quantize"]

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
