"""Decode's products on the file's blocks with integer products (AVX2), the shape of llama.cpp's vec_dot.

x (M, K) is taken per 32 columns as 16-bit integers xi = x / sx (sx = max |x| / 32767; llama.cpp's 8-bit
activations moved decode's KLD and a chat's answer, see kvcli/kernels/cpu/weights.py). Each row of W is read once
for up to 4 rows of x: every 32 codes of a block are unpacked in byte lanes, widened to 16 bits and multiplied by
x's with vpmaddwd, then added into a vector of f32 sums with the block's scale times sx (vectors.ggml_row_dots).
Integer sums are exact; f32 once per 32 codes. A row's bits do not depend on the rows beside it nor on the thread count (each output made by one
thread, in one order). Types: vectors.DOT_TYPES; the others keep ggml_rows.py's f32 slabs.
"""

from __future__ import annotations

import numpy as np

from .compile import RNE, THREADED, available, exact_jit, jit, jit_threaded, numba
from .ggml_rows import _threads
from .vectors import DOT_TYPES

if numba is not None:
    from .vectors import ggml_row_dots1, ggml_row_dots2, ggml_row_dots3, ggml_row_dots4

__all__ = ["DOT_TYPES", "available", "matmul", "quantize_x", "warm_up"]

X_RANGE = 32767  # |xi| of a block's largest element


@exact_jit
def quantize_x(x, xi, xs, xsum, xsum16, x_range):
    """x (M, K) f32 -> xi (M, K) int16 or int8, x / sx rounded to nearest even, sx = max |x| / x_range per 32 columns
    (xs (M, K / 32) f32; 0 and all-zero xi where the block is 0), xsum = sx sum xi; xsum16 (M, K / 16) the same per
    16 columns where it has columns (ggml_tiles' 8-bit x: Q6_K's offset per 16)."""
    M, K = x.shape
    halves = xsum16.shape[1] > 0
    for m in range(M):
        for b in range(K // 32):
            amax = np.float32(0)
            for k in range(32 * b, 32 * b + 32):
                amax = max(amax, abs(x[m, k]))
            if amax == 0:
                xi[m, 32 * b : 32 * b + 32] = 0
                xs[m, b] = 0
                xsum[m, b] = 0
                if halves:
                    xsum16[m, 2 * b : 2 * b + 2] = 0
                continue
            sx = amax / np.float32(x_range)
            inv = np.float32(1) / sx
            totals = [0, 0]
            for h in range(2):
                for k in range(32 * b + 16 * h, 32 * b + 16 * h + 16):
                    v = min(max(np.int32((x[m, k] * inv + RNE) - RNE), -x_range), x_range)
                    xi[m, k] = v
                    totals[h] += v
            xs[m, b] = sx
            xsum[m, b] = sx * np.float32(totals[0] + totals[1])
            if halves:
                xsum16[m, 2 * b] = sx * np.float32(totals[0])
                xsum16[m, 2 * b + 1] = sx * np.float32(totals[1])


@jit
def _span(kind, raw, xi, xs, xsum, y, lo, hi):
    """y[:, lo:hi] for rows lo..hi-1 of W: x's rows by groups of 4 (their sums in registers), the rest by 3, 2 or 1."""
    M = xi.shape[0]
    g0 = 0
    while g0 < M:
        g = M - g0
        if g >= 4:
            ggml_row_dots4(kind, raw, lo, hi, xi, xs, xsum, g0, y)
        elif g == 3:
            ggml_row_dots3(kind, raw, lo, hi, xi, xs, xsum, g0, y)
        elif g == 2:
            ggml_row_dots2(kind, raw, lo, hi, xi, xs, xsum, g0, y)
        else:
            ggml_row_dots1(kind, raw, lo, hi, xi, xs, xsum, g0, y)
        g0 += min(g, 4)


@jit
def quantized(x):
    """x (M, K) f32 -> quantize_x's (xi, xs, xsum), made inside the compiled call (no buffers from Python)."""
    M, K = x.shape
    xi, xs, xsum = np.empty((M, K), np.int16), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)
    quantize_x(x, xi, xs, xsum, np.empty((M, 0), np.float32), X_RANGE)
    return xi, xs, xsum


@jit
def _one(kind, raw, x, y):
    """y = x W.T in the calling thread: x quantized, then _span over every row of W, in one call from Python."""
    xi, xs, xsum = quantized(x)
    _span(kind, raw, xi, xs, xsum, y, 0, raw.shape[0])


@jit_threaded
def _threaded(kind, raw, x, y, threads):
    """_one with W's rows in `threads` runs at once (each output made by one thread as _span makes it)."""
    xi, xs, xsum = quantized(x)
    N = raw.shape[0]
    for t in numba.prange(threads):
        _span(kind, raw, xi, xs, xsum, y, N * t // threads, N * (t + 1) // threads)


def run(one, threaded, kind: int, w: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """y (M, n) f32 = x W.T: x (M, K) f32 contiguous quantized (quantize_x) and multiplied by one(kind, w, x, y) over
    w's first axis, or by threaded(..., threads) at -t N > 1 (ggml_dot's and ggml_tiles' products): one compiled call
    a product (decode runs ~120 of them a token, and each call from Python costs more than a small product's work)."""
    y = np.empty((x.shape[0], n), np.float32)
    threads = _threads()
    if threads > 1 and THREADED:
        threaded(kind, w, x, y, threads)
    else:
        one(kind, w, x, y)
    return y


def matmul(ggml_type: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (M, K) f32 contiguous -> x W.T (M, N) f32, W the (N, K) matrix whose blocks raw (N, row bytes) holds."""
    return run(_one, _threaded, DOT_TYPES.index(ggml_type), raw, x, raw.shape[0])


def warm_up() -> None:
    """Load (or compile, the first time on a machine) the kernels now, for read-only bytes (FileBlocks') at this
    thread count: one compiled kernel serves every type."""
    raw = np.zeros((2, 210), np.uint8)
    raw.setflags(write=False)
    matmul("Q6_K", raw, np.zeros((1, 256), np.float32))
