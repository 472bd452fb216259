"""SwiGLU on the CPU (numba; kvcli/swiglu.py's entry for f32): silu(gate) * up from the fused gate/up product's rows.

One compiled pass where torch takes a chunk, silu and a product (three ops, ~20 us a decode row in a step's cold
caches; libm's expf where torch's is SLEEF's: the two differ in the last bit at times). The decode layer
(decode_layer.py) calls the same function, so a row's bits do not depend on which path ran it; a batch's rows are
split over threads (swiglu_threaded: the same per-row code, a prompt's 512 x 4864 gate took 8% of Qwen's pp512 in
one thread).
"""

from __future__ import annotations

import numpy as np

from .compile import THREADED, jit, jit_threaded, numba


@jit
def _rows(gu, out, lo, hi):
    """out[lo:hi] = silu(gate) * up of gu's rows lo..hi-1."""
    F = out.shape[1]
    for m in range(lo, hi):
        for j in range(F):
            g = gu[m, j]
            out[m, j] = g / (np.float32(1) + np.exp(-g)) * gu[m, F + j]


@jit
def swiglu(gu):
    """gu (M, 2F) f32, gate then up -> (M, F) f32: g / (1 + e^-g) u, as torch's silu writes it."""
    out = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
    _rows(gu, out, 0, gu.shape[0])
    return out


def rows_out(gu, threads: int):
    """swiglu of gu's rows, split over `threads` where numba runs threads (OpenMP)."""
    return swiglu_threaded(gu, threads) if threads > 1 and THREADED else swiglu(gu)


@jit_threaded
def swiglu_threaded(gu, threads):
    """swiglu with the rows split into `threads` runs, one a thread."""
    M = gu.shape[0]
    out = np.empty((M, gu.shape[1] // 2), np.float32)
    for t in numba.prange(threads):
        _rows(gu, out, M * t // threads, M * (t + 1) // threads)
    return out
