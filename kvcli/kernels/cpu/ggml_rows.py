"""Weight matrices kept as the GGUF file's ggml blocks, row after row, and multiplied where they lie (numba).

A matrix W (N, K) of a ggml type is raw (N, K / QK * BYTES) uint8: each row its K / QK blocks in the file's own
bytes (ggml-common.h's block_q4_0 .. block_iq4_xs; QK 32 or 256 elements: TYPES). Each type has a decoder that writes
one block's elements as f32, the values of ggml's dequantize_row_* (a code times a scale is exact in f32, K-quants'
d times a 4-8 bit sub-scale too), as LLVM vectors (vectors.widen_*) but for the IQ4 types' codebook lookups. From
them, one compiled kernel for every type (its index in KINDS an argument, so that numba caches it on disk):
  matmul      y (M, N) = x (M, K) W.T for a few rows of x (decode): SLAB rows of W decoded to f32 in the core's cache,
              then each taken by up to 4 rows of x at once in vector registers, in a fixed order (a row's bits are the
              same alone and beside others, and at any thread count: each output made by one thread);
  dequantize  rows of W as f32 (a prompt batch's slab for a GEMM, the embedding's rows).
Generic LLVM vectors: every CPU LLVM targets runs them (the portable path is the only one).
"""
from __future__ import annotations

import numpy as np

from .compile import FAST, THREADED, available, jit, jit_threaded, numba, numba_threads

if numba is not None:
    from .vectors import (dense_key_scores1, dense_key_scores2, dense_key_scores3, dense_key_scores4, to_f32,
                          widen_bits, widen_nibbles, widen_q6_k, widen_q8_0)

__all__ = ["KINDS", "TYPES", "available", "dequantize", "dequantize_ids", "matmul", "warm_up"]

# ggml type -> (elements a block, bytes a block), ggml-common.h's
TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
         "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
         "IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@jit
def _f16(r, o):
    """The f16 at bytes o, o + 1 of r (little-endian) as f32."""
    return to_f32(np.uint16(np.int32(r[o]) | (np.int32(r[o + 1]) << 8)))


@jit
def _u32(r, o):
    return np.uint32(r[o]) | (np.uint32(r[o + 1]) << 8) | (np.uint32(r[o + 2]) << 16) | (np.uint32(r[o + 3]) << 24)


def _inlined(f):
    """jit's flags, inlined by numba into its caller (_decode_row's loops): LLVM left the calls standing there."""
    return numba.njit(cache=True, nogil=True, fastmath=FAST, inline="always")(f) if numba is not None else f


# ---- one block a decoder: raw's row t, the block at byte o -> buf[i, col : col + QK] (f32), the same values as
# ggml's dequantize_row_*; as LLVM vectors (vectors.widen_*: numba's own loops over a block stay scalar) but for
# the IQ4 types' codebook lookups ----

@_inlined
def _q4_0(raw, t, o, buf, i, col, values):
    """d f16, 16 bytes: element j the low nibble of byte j, j + 16 its high one; w = d (q - 8)."""
    widen_nibbles(raw, t, o + 2, buf, i, col, _f16(raw[t], o), np.float32(0), 8, 0)


@_inlined
def _q4_1(raw, t, o, buf, i, col, values):
    """d, m f16, 16 bytes as Q4_0's; w = d q + m."""
    r = raw[t]
    widen_nibbles(raw, t, o + 4, buf, i, col, _f16(r, o), _f16(r, o + 2), 0, 0)


@_inlined
def _q5_0(raw, t, o, buf, i, col, values):
    """d f16, qh u32 (bit j element j's fifth bit), 16 bytes as Q4_0's; w = d (q - 16)."""
    r = raw[t]
    widen_nibbles(raw, t, o + 6, buf, i, col, _f16(r, o), np.float32(0), 16, np.int64(_u32(r, o + 2)))


@_inlined
def _q5_1(raw, t, o, buf, i, col, values):
    """d, m f16, qh, 16 bytes as Q5_0's; w = d q + m."""
    r = raw[t]
    widen_nibbles(raw, t, o + 8, buf, i, col, _f16(r, o), _f16(r, o + 2), 0, np.int64(_u32(r, o + 4)))


@_inlined
def _q8_0(raw, t, o, buf, i, col, values):
    """d f16, 32 int8 codes; w = d q."""
    widen_q8_0(raw, t, o + 2, buf, i, col, _f16(raw[t], o))


@_inlined
def _q2_k(raw, t, o, buf, i, col, values):
    """scales[16] (a 16-element group's 4-bit scale, low nibble, and 4-bit min, high), qs[64], d, dmin f16;
    w = d sc q - dmin m. Byte l of a half's 32 holds element l (or l - 16) of four groups, two bits each."""
    r = raw[t]
    d, dmin = _f16(r, o + 80), _f16(r, o + 82)
    for half in range(2):
        for j in range(4):
            for g in range(2):
                sc = np.int32(r[o + 8 * half + 2 * j + g])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                widen_bits(raw, t, o + 16 + 32 * half + 16 * g, 2 * j, 3, o, 0, 0, 0, buf, i,
                           col + 128 * half + 32 * j + 16 * g, dl, -ml)


@_inlined
def _q3_k(raw, t, o, buf, i, col, values):
    """hmask[32] (each element's third bit), qs[64] (its low 2 bits, as Q2_K's), scales[12] (16 6-bit scales less
    32: low 4 bits in byte s % 8, nibble s // 8, high 2 in byte 8 + s % 4), d f16; w = d (sc - 32) (q - 4 (1 - h))."""
    r = raw[t]
    d = _f16(r, o + 108)
    for half in range(2):
        for j in range(4):
            for g in range(2):
                s = 8 * half + 2 * j + g
                lo = (np.int32(r[o + 96 + s % 8]) >> (4 * (s // 8))) & 15
                hi = (np.int32(r[o + 104 + s % 4]) >> (2 * (s // 4))) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                widen_bits(raw, t, o + 32 + 32 * half + 16 * g, 2 * j, 3, o + 16 * g, 4 * half + j, 1, 2, buf, i,
                           col + 128 * half + 32 * j + 16 * g, dl, np.float32(-4) * dl)


@jit
def _scale_min_k4(r, s, j):
    """Q4_K / Q5_K's sub-block j scale and min (6 bits each) from the 12 bytes at s (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int32(r[s + j]) & 63, np.int32(r[s + j + 4]) & 63
    sc = (np.int32(r[s + j + 4]) & 15) | ((np.int32(r[s + j - 4]) >> 6) << 4)
    m = (np.int32(r[s + j + 4]) >> 4) | ((np.int32(r[s + j]) >> 6) << 4)
    return sc, m


@_inlined
def _q4_k(raw, t, o, buf, i, col, values):
    """d, dmin f16, scales[12] (8 6-bit scales and mins), qs[128]: bytes 32c..32c+31 sub-block 2c in the low
    nibbles, 2c + 1 in the high ones; w = d sc q - dmin m."""
    r = raw[t]
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            for k in range(2):
                widen_bits(raw, t, o + 16 + 32 * c + 16 * k, 4 * h, 15, o, 0, 0, 0, buf, i,
                           col + 64 * c + 32 * h + 16 * k, dl, -ml)


@_inlined
def _q5_k(raw, t, o, buf, i, col, values):
    """Q4_K's fields with qh[32] before qs: bit 2c + h of byte l the fifth bit of element l of sub-block 2c + h."""
    r = raw[t]
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            for k in range(2):
                widen_bits(raw, t, o + 48 + 32 * c + 16 * k, 4 * h, 15, o + 16 + 16 * k, 2 * c + h, 1, 4, buf, i,
                           col + 64 * c + 32 * h + 16 * k, dl, -ml)


@_inlined
def _q6_k(raw, t, o, buf, i, col, values):
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8 (one a 16 elements), d f16; w = d sc (q - 32)
    (vectors.widen_q6_k: the codes made 32 at a time in byte lanes)."""
    widen_q6_k(raw, t, o, buf, i, col, _f16(raw[t], o + 208))


@_inlined
def _iq4_nl(raw, t, o, buf, i, col, values):
    """d f16, 16 bytes of nibbles as Q4_0's, each an index into the non-linear codebook `values`; w = d values[q]."""
    r, y = raw[t], buf[i]
    d = _f16(r, o)
    for j in range(16):
        b = r[o + 2 + j]
        y[col + j] = d * values[b & 15]
        y[col + j + 16] = d * values[b >> 4]


@_inlined
def _iq4_xs(raw, t, o, buf, i, col, values):
    """d f16, scales_h u16 and scales_l[4] (8 6-bit sub-block scales less 32), qs[128]: 16 bytes a sub-block of 32
    as IQ4_NL's; w = d (ls - 32) values[q]."""
    r, y = raw[t], buf[i]
    d = _f16(r, o)
    sh = np.int32(r[o + 2]) | (np.int32(r[o + 3]) << 8)
    for ib in range(8):
        ls = ((np.int32(r[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        q = o + 8 + 16 * ib
        for j in range(16):
            b = r[q + j]
            y[col + 32 * ib + j] = dl * values[b & 15]
            y[col + 32 * ib + j + 16] = dl * values[b >> 4]


# ---- the kernels: a type by its index in KINDS, every function a plain global (numba caches it on disk) ----

KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
SLAB = 8  # rows of W decoded at a time: their f32 (8 x K x 4 bytes) stay in the core's cache for the products


@jit
def _decode_row(kind, raw, t, buf, i, values):
    """buf[i, :K] = row t of W as f32 (K = buf.shape[1]), its blocks by the decoder of KINDS[kind]."""
    n = buf.shape[1] // 32
    if kind == 0:
        for b in range(n):
            _q4_0(raw, t, 18 * b, buf, i, 32 * b, values)
    elif kind == 1:
        for b in range(n):
            _q4_1(raw, t, 20 * b, buf, i, 32 * b, values)
    elif kind == 2:
        for b in range(n):
            _q5_0(raw, t, 22 * b, buf, i, 32 * b, values)
    elif kind == 3:
        for b in range(n):
            _q5_1(raw, t, 24 * b, buf, i, 32 * b, values)
    elif kind == 4:
        for b in range(n):
            _q8_0(raw, t, 34 * b, buf, i, 32 * b, values)
    elif kind == 5:
        for b in range(n // 8):
            _q2_k(raw, t, 84 * b, buf, i, 256 * b, values)
    elif kind == 6:
        for b in range(n // 8):
            _q3_k(raw, t, 110 * b, buf, i, 256 * b, values)
    elif kind == 7:
        for b in range(n // 8):
            _q4_k(raw, t, 144 * b, buf, i, 256 * b, values)
    elif kind == 8:
        for b in range(n // 8):
            _q5_k(raw, t, 176 * b, buf, i, 256 * b, values)
    elif kind == 9:
        for b in range(n // 8):
            _q6_k(raw, t, 210 * b, buf, i, 256 * b, values)
    elif kind == 10:
        for b in range(n):
            _iq4_nl(raw, t, 18 * b, buf, i, 32 * b, values)
    else:
        for b in range(n // 8):
            _iq4_xs(raw, t, 136 * b, buf, i, 256 * b, values)


@jit
def _span(kind, raw, x, y, lo, hi, values):
    """y[:, n] = x W[n].T for rows n in lo..hi of W: SLAB rows decoded to f32, then each row's products with up to 4
    rows of x at once (vectors.dense_key_scores: a row read once for them, its sums in vector registers, in a fixed
    order: a row's bits do not depend on the rows beside it)."""
    M, K = x.shape
    buf = np.empty((SLAB, K), np.float32)
    s = np.empty((M, SLAB), np.float32)
    for n0 in range(lo, hi, SLAB):
        c = min(SLAB, hi - n0)
        for i in range(c):
            _decode_row(kind, raw, n0 + i, buf, i, values)
        g0 = 0
        while g0 < M:
            g = M - g0
            if g >= 4:
                dense_key_scores4(buf, c, x, g0, s, np.float32(1), buf, 0, 0)
            elif g == 3:
                dense_key_scores3(buf, c, x, g0, s, np.float32(1), buf, 0, 0)
            elif g == 2:
                dense_key_scores2(buf, c, x, g0, s, np.float32(1), buf, 0, 0)
            else:
                dense_key_scores1(buf, c, x, g0, s, np.float32(1), buf, 0, 0)
            g0 += min(g, 4)
        y[:, n0 : n0 + c] = s[:, :c]


@jit_threaded
def _threaded(kind, raw, x, y, threads, values):
    """_span over `threads` runs of whole slabs at once (each output made by one thread as _span makes it)."""
    N = raw.shape[0]
    for t in numba.prange(threads):
        lo = N * t // threads // SLAB * SLAB
        hi = N if t == threads - 1 else N * (t + 1) // threads // SLAB * SLAB
        _span(kind, raw, x, y, lo, hi, values)


@jit_threaded
def _dequantize(kind, raw, ids, out, values):
    """out[i] = W[ids[i]] as f32, rows at once over numba's threads."""
    for i in numba.prange(len(ids)):
        _decode_row(kind, raw, ids[i], out, i, values)


def _threads() -> int:
    import torch

    threads = torch.get_num_threads()
    if not THREADED:
        return 1
    numba_threads(threads)  # at -t 1 too, or a prange region waits on a thread of a busy core
    return threads


def matmul(ggml_type: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (M, K) f32 contiguous -> x W.T (M, N) f32, W the (N, K) matrix whose blocks raw (N, row bytes) holds."""
    kind = KINDS.index(ggml_type)
    y = np.empty((x.shape[0], raw.shape[0]), np.float32)
    threads = _threads()
    if threads > 1:
        _threaded(kind, raw, x, y, threads, IQ4_VALUES)
    else:
        _span(kind, raw, x, y, 0, raw.shape[0], IQ4_VALUES)
    return y


def dequantize_ids(ggml_type: str, raw: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (len(ids), K) f32 <- rows ids (int64) of W."""
    _threads()
    _dequantize(KINDS.index(ggml_type), raw, ids, out, IQ4_VALUES)
    return out


def dequantize(ggml_type: str, raw: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """out (stop - start, K) f32 <- rows start..stop-1 of W."""
    return dequantize_ids(ggml_type, raw, np.arange(start, stop, dtype=np.int64), out)


def warm_up() -> None:
    """Load (or compile, the first time on a machine) the kernels now, for the bytes as the forms hold them (read-only:
    kvcli/weights.py FileBlocks) at this thread count: one compiled kernel serves every type."""
    raw = np.zeros((2, 136), np.uint8)
    raw.setflags(write=False)
    matmul("IQ4_XS", raw, np.zeros((1, 256), np.float32))
    dequantize("IQ4_XS", raw, 0, 2, np.zeros((2, 256), np.float32))
