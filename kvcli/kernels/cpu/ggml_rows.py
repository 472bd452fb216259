"""Weight matrices kept as the GGUF file's ggml blocks, row after row, and multiplied where they lie (numba).

A matrix W (N, K) of a ggml type is raw (N, K / QK * BYTES) uint8: each row its K / QK blocks in the file's own
bytes (ggml-common.h's block_q4_0 .. block_iq4_xs; QK 32 or 256 elements). Each type has a decoder that writes one
block's elements as f32 (exactly ggml's dequantize_row_*: a code times a scale is exact in f32, K-quants' d times
a 4-8 bit sub-scale too), and from it, made once a type by `_kernels`:
  gemv       y (M, N) = x (M, K) W.T for a few rows of x (decode): each block decoded once into a 256-element
             buffer for every row of x, its products summed in LANES partial sums a row (a fixed order: a row's
             bits are the same alone and beside others, and at any thread count, each output made by one thread);
  dequantize rows r0..r1-1 of W as f32 (a prompt batch's slab for a GEMM, the embedding's rows).
The decoders are plain numba loops (portable: any CPU LLVM targets). The types and their block bytes are TYPES.
"""

from __future__ import annotations

import threading

import numpy as np

from .compile import THREADED, available, jit, jit_threaded, numba

if numba is not None:
    from .vectors import (dense_key_scores1, dense_key_scores2, dense_key_scores3, dense_key_scores4, to_f32,
                          widen_bits, widen_nibbles, widen_q8_0)

__all__ = ["TYPES", "available", "dequantize", "dequantize_ids", "matmul", "warm_up"]

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


# ---- one block a decoder: r the row's bytes (uint8), o the block's first byte, y (>= QK) f32 out ----

@jit
def _q4_0(r, o, y, values):
    """d f16, 16 bytes: element j the low nibble of byte j, j + 16 its high one; w = d (q - 8)."""
    d = _f16(r, o)
    for j in range(16):
        b = np.int32(r[o + 2 + j])
        y[j] = d * np.float32((b & 15) - 8)
        y[j + 16] = d * np.float32((b >> 4) - 8)


@jit
def _q4_1(r, o, y, values):
    """d, m f16, 16 bytes as Q4_0's; w = d q + m."""
    d, m = _f16(r, o), _f16(r, o + 2)
    for j in range(16):
        b = np.int32(r[o + 4 + j])
        y[j] = d * np.float32(b & 15) + m
        y[j + 16] = d * np.float32(b >> 4) + m


@jit
def _q5_0(r, o, y, values):
    """d f16, qh (32 fifth bits, bit j element j's), 16 bytes as Q4_0's; w = d (q - 16)."""
    d, qh = _f16(r, o), _u32(r, o + 2)
    for j in range(16):
        b = np.int32(r[o + 6 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        y[j] = d * np.float32(((b & 15) | h0) - 16)
        y[j + 16] = d * np.float32(((b >> 4) | h1) - 16)


@jit
def _q5_1(r, o, y, values):
    """d, m f16, qh, 16 bytes as Q5_0's; w = d q + m."""
    d, m, qh = _f16(r, o), _f16(r, o + 2), _u32(r, o + 4)
    for j in range(16):
        b = np.int32(r[o + 8 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        y[j] = d * np.float32((b & 15) | h0) + m
        y[j + 16] = d * np.float32((b >> 4) | h1) + m


@jit
def _q8_0(r, o, y, values):
    """d f16, 32 int8 codes; w = d q."""
    d = _f16(r, o)
    for j in range(32):
        b = np.int32(r[o + 2 + j])
        y[j] = d * np.float32(b - ((b >> 7) << 8))


@jit
def _iq4_nl(r, o, y, values):
    """d f16, 16 bytes of nibbles as Q4_0's, each an index into the non-linear codebook `values`; w = d values[q]."""
    d = _f16(r, o)
    for j in range(16):
        b = r[o + 2 + j]
        y[j] = d * values[b & 15]
        y[j + 16] = d * values[b >> 4]


@jit
def _q2_k(r, o, y, values):
    """scales[16] (a 16-element group's 4-bit scale, low nibble, and 4-bit min, high), qs[64] (2-bit codes), d, dmin
    f16; w = d sc q - dmin m. Codes: byte l of a 32-byte half holds elements of four groups, two bits each."""
    d, dmin = _f16(r, o + 80), _f16(r, o + 82)
    for half in range(2):
        q = o + 16 + 32 * half
        for j in range(4):
            shift = 2 * j
            for g in range(2):
                sc = np.int32(r[o + 8 * half + 2 * j + g])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                e = 128 * half + 32 * j + 16 * g
                for l in range(16):
                    y[e + l] = dl * np.float32((np.int32(r[q + 16 * g + l]) >> shift) & 3) - ml


@jit
def _q3_k(r, o, y, values):
    """hmask[32] (each element's third bit), qs[64] (low 2 bits), scales[12] (16 6-bit scales less 32), d f16;
    w = d (sc - 32) (q - (0 where its hmask bit is set, else 4))."""
    d = _f16(r, o + 108)
    for half in range(2):
        q = o + 32 + 32 * half
        for j in range(4):
            shift = 2 * j
            bit = 4 * half + j  # the hmask bit of these 32 elements
            for g in range(2):
                i = 8 * half + 2 * j + g  # scale index: low 4 bits in byte i % 8 (nibble i // 8), high 2 in byte 8 + i % 4
                lo = (np.int32(r[o + 96 + i % 8]) >> (4 * (i // 8))) & 15
                hi = (np.int32(r[o + 104 + i % 4]) >> (2 * (i // 4))) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                e = 128 * half + 32 * j + 16 * g
                for l in range(16):
                    m = 16 * g + l
                    low = (np.int32(r[q + m]) >> shift) & 3
                    high = (np.int32(r[o + m]) >> bit) & 1
                    y[e + l] = dl * np.float32(low - 4 + 4 * high)


@jit
def _scale_min_k4(r, s, j):
    """Q4_K / Q5_K's sub-block j scale and min (6 bits each) from the 12 bytes at s (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int32(r[s + j]) & 63, np.int32(r[s + j + 4]) & 63
    sc = (np.int32(r[s + j + 4]) & 15) | ((np.int32(r[s + j - 4]) >> 6) << 4)
    m = (np.int32(r[s + j + 4]) >> 4) | ((np.int32(r[s + j]) >> 6) << 4)
    return sc, m


@jit
def _q4_k(r, o, y, values):
    """d, dmin f16, scales[12] (8 6-bit scales and mins), qs[128]: bytes 32c..32c+31 sub-block 2c in the low
    nibbles, 2c + 1 in the high ones; w = d sc q - dmin m."""
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            e = 64 * c + 32 * h
            for l in range(32):
                y[e + l] = dl * np.float32((np.int32(r[o + 16 + 32 * c + l]) >> (4 * h)) & 15) - ml


@jit
def _q5_k(r, o, y, values):
    """Q4_K's fields with qh[32] before qs: bit 2c + h of byte l the fifth bit of element l of sub-block 2c + h."""
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            e = 64 * c + 32 * h
            for l in range(32):
                q = ((np.int32(r[o + 48 + 32 * c + l]) >> (4 * h)) & 15) | (((np.int32(r[o + 16 + l]) >> (2 * c + h)) & 1) << 4)
                y[e + l] = dl * np.float32(q) - ml


@jit
def _q6_k(r, o, y, values):
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8 (one a 16 elements), d f16; w = d sc (q - 32).
    Each half of 128: element l + 32 i takes ql's byte l (i even) or l + 32 (odd), low nibble for i < 2, and
    bits 2i, 2i + 1 of qh's byte l."""
    d = _f16(r, o + 208)
    for half in range(2):
        ql, qh, sc = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half
        for i in range(4):
            for g in range(2):
                s = np.int32(r[sc + 2 * i + g])
                dl = d * np.float32(s - ((s >> 7) << 8))
                e = 128 * half + 32 * i + 16 * g
                for l in range(16 * g, 16 * g + 16):
                    lo = (np.int32(r[ql + l + 32 * (i & 1)]) >> (4 * (i >> 1))) & 15
                    hi = (np.int32(r[qh + l]) >> (2 * i)) & 3
                    y[e + l - 16 * g] = dl * np.float32((lo | (hi << 4)) - 32)


@jit
def _iq4_xs(r, o, y, values):
    """d f16, scales_h u16 and scales_l[4] (8 6-bit sub-block scales less 32), qs[128]: 16 bytes a sub-block of 32
    as IQ4_NL's; w = d (ls - 32) values[q]."""
    d = _f16(r, o)
    sh = np.int32(r[o + 2]) | (np.int32(r[o + 3]) << 8)
    for ib in range(8):
        ls = ((np.int32(r[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        q = o + 8 + 16 * ib
        for j in range(16):
            b = r[q + j]
            y[32 * ib + j] = dl * values[b & 15]
            y[32 * ib + j + 16] = dl * values[b >> 4]


# ---- 32-element types as LLVM vectors (vectors.widen_*: numba's own loops over a block stay scalar), the same
# values as the plain decoders: raw's row t, block at byte o -> buf[i, col : col + 32] ----

@jit
def _q4_0_v(raw, t, o, buf, i, col, values):
    widen_nibbles(raw, t, o + 2, buf, i, col, _f16(raw[t], o), np.float32(0), 8, 0)


@jit
def _q4_1_v(raw, t, o, buf, i, col, values):
    r = raw[t]
    widen_nibbles(raw, t, o + 4, buf, i, col, _f16(r, o), _f16(r, o + 2), 0, 0)


@jit
def _q5_0_v(raw, t, o, buf, i, col, values):
    r = raw[t]
    widen_nibbles(raw, t, o + 6, buf, i, col, _f16(r, o), np.float32(0), 16, np.int64(_u32(r, o + 2)))


@jit
def _q5_1_v(raw, t, o, buf, i, col, values):
    r = raw[t]
    widen_nibbles(raw, t, o + 8, buf, i, col, _f16(r, o), _f16(r, o + 2), 0, np.int64(_u32(r, o + 4)))


@jit
def _q8_0_v(raw, t, o, buf, i, col, values):
    widen_q8_0(raw, t, o + 2, buf, i, col, _f16(raw[t], o))


@jit
def _q2_k_v(raw, t, o, buf, bi, col, values):
    r = raw[t]
    d, dmin = _f16(r, o + 80), _f16(r, o + 82)
    for half in range(2):
        for j in range(4):
            for g in range(2):
                sc = np.int32(r[o + 8 * half + 2 * j + g])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                widen_bits(raw, t, o + 16 + 32 * half + 16 * g, 2 * j, 3, o, 0, 0, 0, buf, bi,
                           col + 128 * half + 32 * j + 16 * g, dl, -ml)


@jit
def _q3_k_v(raw, t, o, buf, bi, col, values):
    r = raw[t]
    d = _f16(r, o + 108)
    for half in range(2):
        for j in range(4):
            for g in range(2):
                i = 8 * half + 2 * j + g
                lo = (np.int32(r[o + 96 + i % 8]) >> (4 * (i // 8))) & 15
                hi = (np.int32(r[o + 104 + i % 4]) >> (2 * (i // 4))) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                widen_bits(raw, t, o + 32 + 32 * half + 16 * g, 2 * j, 3, o + 16 * g, 4 * half + j, 1, 2, buf, bi,
                           col + 128 * half + 32 * j + 16 * g, dl, np.float32(-4) * dl)


@jit
def _q4_k_v(raw, t, o, buf, bi, col, values):
    r = raw[t]
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            for k in range(2):
                widen_bits(raw, t, o + 16 + 32 * c + 16 * k, 4 * h, 15, o, 0, 0, 0, buf, bi,
                           col + 64 * c + 32 * h + 16 * k, dl, -ml)


@jit
def _q5_k_v(raw, t, o, buf, bi, col, values):
    r = raw[t]
    d, dmin = _f16(r, o), _f16(r, o + 2)
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(r, o + 4, 2 * c + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            for k in range(2):
                widen_bits(raw, t, o + 48 + 32 * c + 16 * k, 4 * h, 15, o + 16 + 16 * k, 2 * c + h, 1, 4, buf, bi,
                           col + 64 * c + 32 * h + 16 * k, dl, -ml)


@jit
def _q6_k_v(raw, t, o, buf, bi, col, values):
    r = raw[t]
    d = _f16(r, o + 208)
    for half in range(2):
        ql, qh, sc = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half
        for i in range(4):
            for g in range(2):
                s = np.int32(r[sc + 2 * i + g])
                dl = d * np.float32(s - ((s >> 7) << 8))
                widen_bits(raw, t, ql + 16 * g + 32 * (i & 1), 4 * (i >> 1), 15, qh + 16 * g, 2 * i, 3, 4, buf, bi,
                           col + 128 * half + 32 * i + 16 * g, dl, np.float32(-32) * dl)


# ---- the kernels a type: rows of W decoded a slab at a time, each slab's rows taken by every row of x ----

SLAB = 8  # rows of W decoded at a time: their f32 (8 x K x 4 bytes) stay in the core's cache for the products


def _make(decode, QK: int, BYTES: int, vector=None):
    """gemv's span, its threaded form and dequantize for one type's decoder (each takes the IQ4 codebook, which
    only the IQ4 types read); vector: the type's block as LLVM vectors, where it has one."""

    if vector is None:
        @jit
        def block(raw, t, o, buf, i, col, values):
            decode(raw[t], o, buf[i, col : col + QK], values)
    else:
        block = vector

    @jit
    def span(raw, x, y, lo, hi, values):
        """y[:, n] = x W[n].T for rows n in lo..hi of W: SLAB rows decoded to f32, then each row's products with up to
        4 rows of x at once (vectors.dense_key_scores: a row read once for them, its sums in vector registers)."""
        M, K = x.shape
        buf = np.empty((SLAB, K), np.float32)
        s = np.empty((M, SLAB), np.float32)
        for n0 in range(lo, hi, SLAB):
            c = min(SLAB, hi - n0)
            for i in range(c):
                for b in range(K // QK):
                    block(raw, n0 + i, BYTES * b, buf, i, QK * b, values)
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
    def threaded(raw, x, y, threads, values):
        N = raw.shape[0]
        for t in numba.prange(threads):  # whole slabs a thread: its rows' bits as one thread makes them
            span(raw, x, y, N * t // threads // SLAB * SLAB, N if t == threads - 1 else N * (t + 1) // threads // SLAB * SLAB,
                 values)

    @jit_threaded
    def dequantize(raw, ids, out, values):
        """out[i] = W[ids[i]] as f32, rows at once over numba's threads."""
        K = out.shape[1]
        for i in numba.prange(len(ids)):
            for b in range(K // QK):
                block(raw, ids[i], BYTES * b, out, i, QK * b, values)

    return span, threaded, dequantize


_DECODERS = {"Q4_0": (_q4_0, _q4_0_v), "Q4_1": (_q4_1, _q4_1_v), "Q5_0": (_q5_0, _q5_0_v), "Q5_1": (_q5_1, _q5_1_v),
             "Q8_0": (_q8_0, _q8_0_v), "Q2_K": (_q2_k, _q2_k_v), "Q3_K": (_q3_k, _q3_k_v),
             "Q4_K": (_q4_k, _q4_k_v), "Q5_K": (_q5_k, _q5_k_v), "Q6_K": (_q6_k, _q6_k_v), "IQ4_NL": (_iq4_nl, None), "IQ4_XS": (_iq4_xs, None)}
_KERNELS = {t: _make(dec, *TYPES[t], vec) for t, (dec, vec) in _DECODERS.items()} if numba is not None else {}
_state = threading.local()


def _threads() -> int:
    import torch

    threads = torch.get_num_threads()
    if threads > 1 and THREADED and getattr(_state, "threads", 0) != threads:  # numba's count is per thread
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        _state.threads = threads
    return threads if THREADED else 1


def matmul(ggml_type: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (M, K) f32 contiguous -> x W.T (M, N) f32, W the (N, K) matrix whose blocks raw (N, row bytes) holds."""
    span, threaded, _ = _KERNELS[ggml_type]
    y = np.empty((x.shape[0], raw.shape[0]), np.float32)
    threads = _threads()
    if threads > 1:
        threaded(raw, x, y, threads, IQ4_VALUES)
    else:
        span(raw, x, y, 0, raw.shape[0], IQ4_VALUES)
    return y


def dequantize_ids(ggml_type: str, raw: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (len(ids), K) f32 <- rows ids (int64) of W."""
    _threads()
    _KERNELS[ggml_type][2](raw, ids, out, IQ4_VALUES)
    return out


def dequantize(ggml_type: str, raw: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """out (stop - start, K) f32 <- rows start..stop-1 of W."""
    return dequantize_ids(ggml_type, raw, np.arange(start, stop, dtype=np.int64), out)


def warm_up(ggml_type: str) -> None:
    """Load (or compile, the first time on a machine) a type's kernels now."""
    QK, BYTES = TYPES[ggml_type]
    raw = np.zeros((2, BYTES), np.uint8)
    raw.setflags(write=False)  # as the forms hold their bytes (kvcli/weights.py FileBlocks): the same compiled kernel
    matmul(ggml_type, raw, np.zeros((1, QK), np.float32))
    dequantize(ggml_type, raw, 0, 2, np.zeros((2, QK), np.float32))
