"""Decode's products on 8 rows' blocks interleaved: integer products with 8 rows of W in one vector's lanes (AVX2;
VNNI where compiled for), the idea of llama.cpp's repacked q4_0_8x8 / q4_K_8x8 for its gemv.

ggml_dot reads one row's block at a time: per 32 codes it unpacks, converts its int32 sums to f32, scales and adds,
and at the row's end sums 8 lanes; a third of its instructions go to what is per block, not per code. Here a tile
holds 8 rows' blocks of the same columns (retile: the same bytes, reordered, so the same size), their units in the
order the kernel reads them (vectors.tile_order: a tile read front to back, the stream the CPU prefetches), and each
row's sum stays in its own int32 lane over a block; per block and 8 rows one conversion, one fma with the 8 scales
times sx and one with the mins times xsum. Two ways with x:
  WORD_TYPES (Q4_0-Q8_0): x as ggml_dot quantizes it (15-bit); a run of 16 code bytes (one 16-bit unit of the 8
      rows) widened to 16-bit lanes holds 8 rows' codes of two columns, one x pair (a splat 32-bit word) meets them
      in vpmaddwd (vectors.ggml_tile_dots). 8-bit x moved SmolLM2's (Q4_1) decode KLD to 0.0028 (benchmarks/README.md).
  QUAD_TYPES (Q4_K, Q5_K, Q6_K): x as llama.cpp's q8 activations, 8-bit per 32 columns (quantized8); the codes lie
      in pieces of 4 bytes a row, so 32 bytes are 8 rows' 4 columns, and one x quad (a splat 32-bit word) meets them
      in vpmaddubsw (or VNNI's vpdpbusd): half the instructions a code of the 16-bit way (vectors.ggml_quad_dots).
      Qwen2.5-Coder's decode KLD against --weights f32 0.00014; the synthetic 1B's decode 1.28-1.3x as fast, now at
      the memory's rate (benchmarks/README.md section 14).
A row's bits do not depend on the rows beside it nor on the thread count. Rows a multiple of 8. The K-quants' prompt
batches run here too (weights.tiles_kernel_rows), W's tiles taken by blocks, each by every row of x (_span8).
"""

from __future__ import annotations

import functools

import gguf
import numpy as np

from . import ggml_dot
from .compile import available, jit, jit_threaded, numba
from .ggml_rows import IQ4_VALUES, KINDS, _decode_row, _threads
from .vectors import QUAD_TYPES, TILE_ROWS, TILE_TYPES, WORD_TYPES, tile_order, tile_places

if numba is not None:
    from .vectors import bf16_from_f32
    from .vectors import ggml_quad_batch4, ggml_quad_dots1, ggml_quad_dots2, ggml_quad_dots3, ggml_quad_dots4
    from .vectors import ggml_tile_dots1, ggml_tile_dots2, ggml_tile_dots3, ggml_tile_dots4

__all__ = ["QUAD_TYPES", "TILE_ROWS", "TILE_TYPES", "WORD_TYPES", "available", "decoded", "matmul", "retile", "unit_place",
           "untile", "warm_up"]


@jit_threaded
def _to_tiles(raw, tiles, lo, hi, order, place, width, qh):
    """tiles[lo..hi-1] (T, 8 row units) <- raw (8 T, row units), in 16-bit units (every field starts at an even
    byte): unit order[p] of row r's block -> unit place[p] + width[p] r of the tile's block (vectors.tile_order's
    pieces: width 1 or 2); Q5_0 / Q5_1's fifth
    bits (qh >= 0: the first of their two units, in place) regrouped by lane: element 2c + e + 16h of row r -> bit
    c + 8h of the word at unit 8 qh + 2r + e (the tile's lane 2r + e of a code run: one shift and one mask give a
    run's fifth bits, vectors.ggml_tile_dots)."""
    units = order.shape[0]
    for t in numba.prange(lo, hi):
        for b in range(raw.shape[1] // units):
            o, src = 8 * b * units, b * units
            for p in range(units):
                for r in range(8):
                    tiles[t, o + place[p] + width[p] * r] = raw[8 * t + r, src + order[p]]
            if qh >= 0:
                for r in range(8):
                    bits = np.uint32(raw[8 * t + r, src + qh]) | (np.uint32(raw[8 * t + r, src + qh + 1]) << 16)
                    for e in range(2):
                        word = np.uint32(0)
                        for h in range(2):
                            for c in range(8):
                                word |= ((bits >> (2 * c + e + 16 * h)) & 1) << (c + 8 * h)
                        tiles[t, o + 8 * qh + 2 * r + e] = np.uint16(word)


@jit
def _untile_one(tiles, t, raw, row0, order, place, width, qh):
    """_to_tiles' inverse for tile t into raw's rows row0 .. row0 + 7 (16-bit units both)."""
    units = order.shape[0]
    for b in range(raw.shape[1] // units):
        o, dst = 8 * b * units, b * units
        for p in range(units):
            for r in range(8):
                raw[row0 + r, dst + order[p]] = tiles[t, o + place[p] + width[p] * r]
        if qh >= 0:
            for r in range(8):
                bits = np.uint32(0)
                for e in range(2):
                    word = np.uint32(tiles[t, o + 8 * qh + 2 * r + e])
                    for h in range(2):
                        for c in range(8):
                            bits |= ((word >> (c + 8 * h)) & 1) << (2 * c + e + 16 * h)
                raw[row0 + r, dst + qh] = np.uint16(bits & 0xFFFF)
                raw[row0 + r, dst + qh + 1] = np.uint16(bits >> 16)


@jit_threaded
def _from_tiles(tiles, raw, lo, hi, order, place, width, qh):
    """_to_tiles' inverse for tiles lo..hi-1 into raw's rows 0 .. 8 (hi - lo) - 1 (threaded: a batch's slabs put back
    took 7% of Qwen's pp512 in one thread)."""
    for t in numba.prange(lo, hi):
        _untile_one(tiles, t, raw, 8 * (t - lo), order, place, width, qh)


@jit_threaded
def _decoded(tiles, lo, hi, order, place, width, qh, kind, values, out, bf16, threads):
    """out[8 (t - lo) + r] = row r of tile t as ggml_rows decodes it (its KINDS[kind]), tiles lo..hi-1 in `threads`
    runs: each tile put back into an 8-row buffer and each row decoded into an f32 row in the core's cache, then
    written to out (rows, K) as f32, or as bf16 bits (out int16) where bf16: a batch's slab in one pass over the
    tiles, where untile, a decode and a conversion each wrote the slab (the 1B's pp512 spent 12% there)."""
    K = out.shape[1]
    for c in numba.prange(threads):
        raw = np.empty((8, tiles.shape[1] // 8), np.uint16)
        row = np.empty((1, K), np.float32)
        as_bytes = raw.view(np.uint8)
        for t in range(lo + (hi - lo) * c // threads, lo + (hi - lo) * (c + 1) // threads):
            _untile_one(tiles, t, raw, 0, order, place, width, qh)
            for r in range(8):
                _decode_row(kind, as_bytes, r, row, 0, values)
                o = 8 * (t - lo) + r
                if bf16:
                    for k in range(K):
                        out[o, k] = bf16_from_f32(row[0, k])
                else:
                    for k in range(K):
                        out[o, k] = row[0, k]


@functools.cache
def _layout(ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(a block's 16-bit units in the tile's order, the tile unit of each one's row 0 copy, its piece's width (the
    units between rows), the first unit of its fifth bits to regroup or -1)."""
    pieces = tile_order(ggml_type)
    order = np.array([u for piece in pieces for u in piece], np.int64)
    places = tile_places(ggml_type)
    width = np.array([len(piece) for piece in pieces for _ in piece], np.int64)
    return order, np.array([places[u] for u in order], np.int64), width, {"Q5_0": 1, "Q5_1": 2}.get(ggml_type, -1)


def unit_place(ggml_type: str, unit: int) -> int:
    """The tile block's 16-bit unit that holds row 0's copy of a block's unit `unit` (a one-unit piece's 8 rows
    follow it: the f16 fields')."""
    return tile_places(ggml_type)[unit]


def _units(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint16).reshape(a.shape[0], -1)


RETILE_TILES = 1024  # tiles made at a time by retile, after which `done` may let the source's pages go


def retile(ggml_type: str, raw: np.ndarray, done=None, empty=np.empty) -> np.ndarray:
    """raw (N, row bytes) of the file's blocks, N a multiple of 8 -> tiles (N / 8, row bytes x 8) as
    vectors.ggml_tile_dots reads them: the same bytes reordered, into empty(shape, dtype) (a load's: kvcli/memory.py
    mapped_empty); done(rows of raw) after each run of them is made (a memory map's pages read so far can go: the
    load's peak is the tiles plus one run)."""
    tiles = empty((raw.shape[0] // TILE_ROWS, raw.shape[1] * TILE_ROWS), np.uint8)
    _threads()
    src, dst = _units(np.ascontiguousarray(raw)), _units(tiles)
    for lo in range(0, tiles.shape[0], RETILE_TILES):
        hi = min(lo + RETILE_TILES, tiles.shape[0])
        _to_tiles(src, dst, lo, hi, *_layout(ggml_type))
        if done is not None:
            done(raw[TILE_ROWS * lo : TILE_ROWS * hi])
    return tiles


def untile(ggml_type: str, tiles: np.ndarray, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """retile's inverse for tiles lo..hi-1: the file's blocks of rows 8 lo .. 8 hi - 1 (8 (hi - lo), row bytes)."""
    hi = tiles.shape[0] if hi is None else hi
    raw = np.empty((TILE_ROWS * (hi - lo), tiles.shape[1] // TILE_ROWS), np.uint8)
    _from_tiles(_units(tiles), _units(raw), lo, hi, *_layout(ggml_type))
    return raw


def decoded(ggml_type: str, tiles: np.ndarray, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
    """Rows 8 lo .. 8 hi - 1 of W as f32 (out float32 (8 (hi - lo), K)) or bf16 (out int16 of bf16 bits), out filled
    and returned: untile and ggml_rows' decoder in one pass."""
    threads = _threads()
    _decoded(_units(tiles), lo, hi, *_layout(ggml_type), KINDS.index(ggml_type), IQ4_VALUES, out, out.dtype == np.int16,
             max(1, min(threads, hi - lo)))
    return out


@jit
def _span(kind, tiles, xi, xs, xsum, y, lo, hi):
    """y[:, 8 lo:8 hi] for tiles lo..hi-1: x's rows by groups of 4, the rest by 3, 2 or 1."""
    M = xi.shape[0]
    g0 = 0
    while g0 < M:
        g = M - g0
        if g >= 4:
            ggml_tile_dots4(kind, tiles, lo, hi, xi, xs, xsum, g0, y)
        elif g == 3:
            ggml_tile_dots3(kind, tiles, lo, hi, xi, xs, xsum, g0, y)
        elif g == 2:
            ggml_tile_dots2(kind, tiles, lo, hi, xi, xs, xsum, g0, y)
        else:
            ggml_tile_dots1(kind, tiles, lo, hi, xi, xs, xsum, g0, y)
        g0 += min(g, 4)


X8_RANGE = 127  # |xq| of a block's largest element: 8-bit activations (QUAD_TYPES)


@jit
def quantized8(x):
    """x (M, K) f32 -> ggml_dot.quantize_x's (xq, xs, xsum, xsum16) at 8 bits (|xq| <= X8_RANGE), made inside the
    compiled call."""
    M, K = x.shape
    xq, xs = np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32)
    xsum, xsum16 = np.empty((M, K // 32), np.float32), np.empty((M, K // 16), np.float32)
    ggml_dot.quantize_x(x, xq, xs, xsum, xsum16, X8_RANGE)
    return xq, xs, xsum, xsum16


TILE_BLOCK_BYTES = 64 << 10  # tiles a batch's rows of x take in turn: the block stays in the core's L2 meanwhile


@jit
def _span8(kind, tiles, xq, xs, xsum, xsum16, y, lo, hi):
    """_span for QUAD_TYPES[kind] and 8-bit x. A batch (more than 4 rows) takes tiles lo..hi-1 by blocks of
    TILE_BLOCK_BYTES, each by every group of x's rows before the next: W is read once from memory, not once a group,
    and from L2 by the kernel whose loads LLVM places (ggml_quad_batch4)."""
    M = xq.shape[0]
    block = max(1, TILE_BLOCK_BYTES // tiles.shape[1]) if M > 4 else max(1, hi - lo)
    for t0 in range(lo, hi, block):
        t1 = min(hi, t0 + block)
        g0 = 0
        while g0 < M:
            g = M - g0
            if g >= 4 and M > 4:
                ggml_quad_batch4(kind, tiles, t0, t1, xq, xs, xsum, xsum16, g0, y)
            elif g >= 4:
                ggml_quad_dots4(kind, tiles, t0, t1, xq, xs, xsum, xsum16, g0, y)
            elif g == 3:
                ggml_quad_dots3(kind, tiles, t0, t1, xq, xs, xsum, xsum16, g0, y)
            elif g == 2:
                ggml_quad_dots2(kind, tiles, t0, t1, xq, xs, xsum, xsum16, g0, y)
            else:
                ggml_quad_dots1(kind, tiles, t0, t1, xq, xs, xsum, xsum16, g0, y)
            g0 += min(g, 4)


WORDS = len(WORD_TYPES)  # kinds from here on (TILE_TYPES' K-quants) take 8-bit x


@jit
def _one(kind, tiles, x, y):
    """y = x W.T in the calling thread, x quantized in the same call (ggml_dot.run): 16-bit for WORD_TYPES, 8-bit
    for QUAD_TYPES."""
    if kind >= WORDS:
        xq, xs, xsum, xsum16 = quantized8(x)
        _span8(kind - WORDS, tiles, xq, xs, xsum, xsum16, y, 0, tiles.shape[0])
    else:
        xi, xs, xsum = ggml_dot.quantized(x)
        _span(kind, tiles, xi, xs, xsum, y, 0, tiles.shape[0])


@jit_threaded
def _threaded(kind, tiles, x, y, threads):
    """_one with x's rows quantized in `threads` runs, then W's tiles in `threads` runs (each row of x and each column
    of y made as _one makes it: the same bits at any thread count)."""
    T, (M, K) = tiles.shape[0], x.shape
    xs, xsum = np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)  # x's per 32 columns
    if kind >= WORDS:
        xq, xsum16 = np.empty((M, K), np.int8), np.empty((M, K // 16), np.float32)
        for t in numba.prange(threads):
            a, b = M * t // threads, M * (t + 1) // threads
            ggml_dot.quantize_x(x[a:b], xq[a:b], xs[a:b], xsum[a:b], xsum16[a:b], X8_RANGE)
        for t in numba.prange(threads):
            _span8(kind - WORDS, tiles, xq, xs, xsum, xsum16, y, T * t // threads, T * (t + 1) // threads)
    else:
        xi, no16 = np.empty((M, K), np.int16), np.empty((M, 0), np.float32)  # no sums per 16 (16-bit x)
        for t in numba.prange(threads):
            a, b = M * t // threads, M * (t + 1) // threads
            ggml_dot.quantize_x(x[a:b], xi[a:b], xs[a:b], xsum[a:b], no16[a:b], ggml_dot.X_RANGE)
        for t in numba.prange(threads):
            _span(kind, tiles, xi, xs, xsum, y, T * t // threads, T * (t + 1) // threads)


def matmul(ggml_type: str, tiles: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (M, K) f32 contiguous -> x W.T (M, N) f32, W's blocks as retile lays them in tiles (N / 8, ...)."""
    return ggml_dot.run(_one, _threaded, TILE_TYPES.index(ggml_type), tiles, x, tiles.shape[0] * TILE_ROWS)


def warm_up() -> None:
    tiles = np.zeros((1, 8 * 22), np.uint8)
    tiles.setflags(write=False)
    matmul("Q5_0", tiles, np.zeros((1, 32), np.float32))  # one compiled kernel: 16-bit and 8-bit x alike
