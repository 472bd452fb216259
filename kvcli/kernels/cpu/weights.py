"""Decode's products on the CPU: a few rows of x times an Int4 form (or an Int8's, its two 4-bit halves read
together as 8-bit codes) through AVX512-VNNI byte dot products, in one compiled pass (numba; the inner block written
as LLVM vectors, which numba's own loops do not make of 4-bit codes).

torch's int4 GEMV widens every code to f32 and spends an f32 FMA per row on each; rows cost it nearly as much as
the first. Here x is taken per 32 columns as integers xi = x / sx (sx = max |x| / 32512, so |xi| <= 127 * 256)
in two int8 limbs, xi = 256 hi + lo: 15-bit activations, finer than bf16's 8 bits where a block's values are
within 2^7 of its largest (one int8 limb, llama.cpp's q8 activations, turned a chat's answer: an outlier leaves
the rest of its block a few levels). Four columns of a tile (16 bytes each) become one vector of 16 rows' four
codes once for every row of x; each row takes it in one instruction a limb (vpdpbusd: 64 products of unsigned
codes by signed limbs, summed by four into int32 lanes kept in registers over a 32-column block); then, per
block, y += s sx (xi . q) + (z - 8 s) sx sum xi, which is (sx xi) . ((q - 8) s + z). The integer sums are exact,
y is f32. The codes stream from memory, so each block asks for the bytes BYTE_DOT_PREFETCH ahead. Every row is computed in the
same order whatever shares the call: a row's bits are the same alone and beside others (the server's slots). At
-t N > 1 the tiles are split in N runs made at once (numba's OpenMP threads), each column by one thread as one thread
makes it: the same bits at any thread count. Figures: benchmarks/README.md.

The blocks' LLVM code (byte_dot_block, byte_dot_block8) is in vectors.py, with every llvmlite line of the CPU
kernels; the kernel's table entries (kernel_table.PRODUCT, AVX512: it needs VNNI and VBMI) are kvcli/weights.py's.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .compile import RNE, THREADED, available, exact_jit, jit, jit_threaded, numba, numba_threads
from .vectors import BYTE_DOT_CHUNK as CHUNK, BYTE_DOT_GROUP as GROUP

if numba is not None:  # the blocks' LLVM code (vectors.py): AVX512-VNNI byte dot products, VBMI byte permutes
    from .vectors import byte_dot_block as _block, byte_dot_block8 as _block8

__all__ = ["MAX_ROWS", "Operands", "available", "covers", "warm_up"]

MAX_ROWS = 8  # rows of x per call
GROUP_ROWS = 4  # rows a block is taken by at once: their 16 int32 vectors of sums stay in registers
TILES_AT_ONCE = 32  # Int8's parts: 32 tiles' rows of y (<= 64 KB) are summed over every part before the next
ROWS = {m: 1 << (m - 1).bit_length() for m in range(1, MAX_ROWS + 1)}  # padded to the compiled counts
X_RANGE = 127 * 256  # |x| of a block's largest element as integer limbs 256 hi + lo: hi = (xi + 128) >> 8 fits int8


def covers(tile: int | None) -> bool:
    """Tiles whose half rows split into whole chunks (T = 32, 64: AVX2's and AVX-512's layouts)."""
    return available() and tile is not None and (tile // 2) % CHUNK == 0


@exact_jit
def quantize_rows(x, doubled, xq, xs):
    """x (M, K) f32 -> xq (2, rows, P Kp) int8 and xs (rows, P, Kp / 32, 2) f32, what the kernel reads: each block of
    32 columns of x as integers xi = 256 hi + lo (|xi| <= 127 * 256; hi, lo int8 in xq[0], xq[1]) with a scale
    sx = max |x| / 32512 (xi = x (1 / sx) rounded to nearest even; all 0 where the block is), and (sx, sx sum xi);
    rows past M zero. doubled (Int8's parts): part p's columns are x's Kp / 2 columns of it twice (K = P Kp / 2),
    else x's Kp of it. Exact IEEE arithmetic (no fast-math): the tests reproduce it."""
    M = x.shape[0]
    rows, P, G, _ = xs.shape
    Kp = G * GROUP
    C = Kp // 2 if doubled else Kp
    for m in range(rows):
        for p in range(P):
            for g in range(G):
                k0 = Kp * p + GROUP * g
                amax = np.float32(0)
                if m < M:
                    for k in range(GROUP * g, GROUP * g + GROUP):
                        amax = max(amax, abs(x[m, C * p + k % C]))
                if amax == 0:
                    xq[:, m, k0 : k0 + GROUP] = 0
                    xs[m, p, g, 0] = 0
                    xs[m, p, g, 1] = 0
                    continue
                sx = amax / np.float32(X_RANGE)
                inv = np.float32(1) / sx
                total = 0
                for k in range(GROUP * g, GROUP * g + GROUP):
                    xi = min(max(np.int32((x[m, C * p + k % C] * inv + RNE) - RNE), -X_RANGE), X_RANGE)
                    hi = (xi + 128) >> 8
                    xq[0, m, k0 + k - GROUP * g] = hi
                    xq[1, m, k0 + k - GROUP * g] = xi - 256 * hi
                    total += xi
                xs[m, p, g, 0] = sx
                xs[m, p, g, 1] = sx * np.float32(total)


@jit
def _gemv(tiles, sz, x, doubled, xq, groups, xs, y):
    """y (rows, N_pad) f32 = x W.T, TILES_AT_ONCE tiles at a time (their rows of y stay in cache over every part,
    and each part's bytes of them are read in one run).
    tiles (P, NT, Kp, T / 2) uint8, byte (p, i, k, j) holding the codes of column Kp p + k of W's rows T i + j (low
    nibble) and T i + j + T / 2 (high); sz (P, Kp / 32, N_pad) int32, bf16 bits of each block's scale s (low half)
    and zero point z (high), W = (q - 8) s + z; x (M, K) f32, M <= rows. Scratch: xq (2, rows, P Kp) int8 and xs,
    quantize_rows'; groups: xq's rows by GROUP_ROWS, each a tuple of their limbs as (P, Kp / 4) int32 (the group's
    high limbs, then its low ones)."""
    quantize_rows(x, doubled, xq, xs)
    _span(tiles, sz, doubled, groups, xs, y, 0, tiles.shape[1])


# _gemv with the tiles split in `threads` runs at once (-t N), each of y's columns made by one thread as _gemv makes it
# (the same bits at any thread count); one kernel a count of rows: numba's threads take arrays, not _gemv's tuples,
# so each builds its groups from hi, lo = xq's limbs (2, rows, P, Kp / 4) int32.


@jit_threaded
def _threaded_1(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], lo[0]),), xs, y, *_run(tiles, t, threads))


@jit_threaded
def _threaded_2(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], lo[0], lo[1]),), xs, y, *_run(tiles, t, threads))


@jit_threaded
def _threaded_4(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]),), xs, y,
              *_run(tiles, t, threads))


@jit_threaded
def _threaded_8(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]),
                                   (hi[4], hi[5], hi[6], hi[7], lo[4], lo[5], lo[6], lo[7])), xs, y,
              *_run(tiles, t, threads))


_THREADED = {1: _threaded_1, 2: _threaded_2, 4: _threaded_4, 8: _threaded_8}


@jit
def _run(tiles, t, threads):
    """Thread t's tiles of `threads` runs: lo, hi."""
    NT = tiles.shape[1]
    return NT * t // threads, NT * (t + 1) // threads


@jit
def _span(tiles, sz, doubled, groups, xs, y, lo, hi):
    """_gemv's products for tiles lo..hi (y's columns T lo .. T hi): each block is taken by one group of rows after the
    other while its bytes are at hand (a group's sums stay in registers; eight rows' would not)."""
    T = 2 * tiles.shape[3]
    y[:, T * lo : T * hi] = 0
    P = tiles.shape[0]
    G = xs.shape[2]
    for i0 in range(lo, hi, TILES_AT_ONCE):
        for p in range(P):
            for i in range(i0, min(i0 + TILES_AT_ONCE, hi)):
                if doubled:  # an Int8 part: its halves' blocks g and g + G / 2 as one block of 8-bit codes
                    for g in range(G // 2):
                        for r in range(len(groups)):
                            m = GROUP_ROWS * r
                            _block8(tiles, p, i, g, groups[r], sz, xs[m : m + GROUP_ROWS], y[m : m + GROUP_ROWS])
                else:
                    for g in range(G):
                        for r in range(len(groups)):
                            m = GROUP_ROWS * r
                            _block(tiles, p, i, g, groups[r], sz, xs[m : m + GROUP_ROWS], y[m : m + GROUP_ROWS])


_scratch = threading.local()


def _buffers(rows: int, P: int, Kp: int):
    """This thread's scratch for _gemv (xq, its rows' limbs as int32: by groups, and whole; xs), made once per shape."""
    cache = _scratch.__dict__.setdefault("by_shape", {})
    key = (rows, P, Kp)
    if key not in cache:
        xq = np.zeros((2, rows, P * Kp), np.int8)
        limbs = xq.view(np.int32).reshape(2, rows, P, Kp // 4)
        step = min(rows, GROUP_ROWS)
        groups = tuple(tuple(limbs[0, m : m + step]) + tuple(limbs[1, m : m + step]) for m in range(0, rows, step))
        cache[key] = xq, groups, (limbs[0], limbs[1]), np.zeros((rows, P, Kp // GROUP, 2), np.float32)
    return cache[key]


class Operands:
    """A form's codes and scales as the kernel reads them (numpy views, made once): packed (P, N_pad, Kp / 2) uint8
    and sz (P, Kp / 32, N_pad, 2) bf16 as Int4 keeps them (P = 1) or Int8 its parts (doubled: see _gemv)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, tile: int, doubled: bool = False):
        P, self.n_pad, half = packed.shape
        self.tiles = packed.view(P, -1, 2 * half, tile // 2).numpy()
        self.sz = sz.view(torch.int32).squeeze(-1).numpy()
        self.doubled = doubled

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) f32 contiguous, M <= MAX_ROWS -> x W.T (M, N_pad) f32, x quantized to int8 per 32 columns
        (quantize_rows); the rows padded to 1, 2, 4 or 8 (a compiled kernel each)."""
        M = x.shape[0]
        rows, (P, _, Kp, _) = ROWS[M], self.tiles.shape
        xq, groups, limbs, xs = _buffers(rows, P, Kp)
        y = np.empty((rows, self.n_pad), np.float32)
        threads = torch.get_num_threads()
        if threads > 1 and THREADED:  # -t N: the tiles in N runs at once
            numba_threads(threads)
            _THREADED[rows](self.tiles, self.sz, x.numpy(), self.doubled, xq, *limbs, xs, y, threads)
        else:
            _gemv(self.tiles, self.sz, x.numpy(), self.doubled, xq, groups, xs, y)
        return torch.from_numpy(y)[:M]


def warm_up(rows: int = MAX_ROWS) -> None:
    """Load (or compile, the first time on a machine: a second or so each) the kernels for 1..rows rows now."""
    tile = 64
    for doubled in (False, True):  # Int4's forms and Int8's
        ops = Operands(torch.zeros(1, tile, GROUP, dtype=torch.uint8), torch.zeros(1, 2, tile, 2, dtype=torch.bfloat16),
                       tile, doubled)
        for m in sorted({ROWS[r] for r in range(1, rows + 1)}):
            ops.matmul(torch.zeros(m, GROUP if doubled else 2 * GROUP))
