"""Resident weight forms: a GGUF matrix kept as its file stores it, multiplied where it lies; and the kernel table's
entries for the weights' roles (kvcli/kernel_table.py: PRODUCT, ROWS, NORM), with `rms_norm`, which asks it.

Each form holds one matrix W (N, K) (torch order: N outputs, K inputs) and offers
  matmul(x)     x (..., K) f32 -> (..., N) f32, x @ W.T;
  rows(ids)     rows of W by index, f32 (the token embedding: only the rows asked for);
  dequantize()  W (N, K) f32, the reference the tests use;
  nbytes        the bytes it keeps resident.
Forms (chosen per tensor by `resident_form`, from its GGUF type), each with a `kind`, its key in the kernel table:
  Int4  Q4_0 / Q4_1 / Q4_K on a CPU without AVX2: 4-bit codes with a per-32 scale and zero point, in torch's packed
        layout for its int4 weight-only GEMM (kvcli/kernels/cpu/int4_tiles.py): W = (q - 8) d + z.
  Int8  Q8_0 as int8 codes (N, K) and the f16 block scales (N, K / 32), W = d q, for the AVX512-VNNI kernel: no
        longer chosen for a file (1.24x Q8_0's bytes, and FileTiles' kernel decodes faster on the AVX-512 EPYC
        measured, benchmarks/README.md); load(tensor, "int8") makes one.
  FileBlocks (CPU) the other ggml types of FILE_BLOCKS (Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL, IQ4_XS; without AVX2 Q8_0
        too): the file's own blocks, a view of the memory map, decoded where multiplied (kvcli/kernels/cpu/ggml_rows.py).
  FileTiles (CPU with AVX2, AVX-512 included) the types of ggml_tiles (Q4_0-Q8_0, Q4_K-Q6_K): the file's blocks
        regrouped 8 rows at a time, as many bytes (kvcli/kernels/cpu/ggml_tiles.py).
  Blocks (CUDA) the same types as blocks of 32 in ggml's order with f16 scale and min, for the Triton
        decode kernel (kvcli/kernels/gpu/weights.py): int4_cuda (Q4_*) and int8_cuda (Q8_0).
  Dense everything else, and every matrix under --weights f16 / f32: a plain tensor (its own product, no kernel).
A form asks the table for its PRODUCT entry once, at its first product (the table chooses once per kind, device and
machine), and keeps it: a decode step's product costs no lookup. A file's forms run ggml_tiles' or ggml_dot's byte
products up to FILE_GEMV_ROWS rows (the K-quants' tiles: any batch, tiles_kernel_rows); an Int4 or Int8 form up to 8
rows kvcli's int8-dot kernel where AVX512-VNNI (and VBMI) runs (kvcli/kernels/cpu/weights.py), then torch's int4 GEMV;
a prefill batch dequantizes slabs of W (ROWS) and runs a GEMM, in bf16 where the CPU multiplies bf16 in hardware
(batch_dtype); on CUDA the Triton kernel up to KERNEL_ROWS rows, slabs in the compute dtype beyond (figures in
benchmarks/README.md). `kernel_lines()` lists the choices.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

from kvcli import kernel_table as table
from kvcli.gguf_file import drop_view_pages
from kvcli.kernel_table import AVX2, AVX512, BF16, NORM, PRODUCT, ROPE, ROWS, SWIGLU, Entry
from kvcli.kernels.cpu.int4_tiles import GROUP, pack_pairs, tile_width, unpack_pairs
from kvcli.memory import mapped_empty

# Rows up to which a FileBlocks product runs on the blocks (a slab of rows decoded for every row of x); a larger batch
# decodes f32 slabs for a GEMM.
FILE_GEMV_ROWS = 16
# The K-quants' tiles (8-bit x, W read once per block of tiles for every row of x) take a batch of any size where they
# beat slabs + GEMM: Q4_K and Q5_K everywhere (the synthetic 1B's pp512 1.15x beside bf16 GEMMs on the AVX-512 EPYC),
# Q6_K where the GEMM is f32 (1.18x with the others on AVX2 paths); beside a bf16 GEMM Q6_K's per-16 scales lose
# (pp512 0.85x), so it stays at FILE_GEMV_ROWS there (benchmarks/README.md section 14).
TILE_BATCH_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def tiles_kernel_rows(ggml_type: str) -> int | float:
    """Rows up to which a FileTiles product of this type runs on the tiles (more: slabs + GEMM)."""
    if ggml_type in TILE_BATCH_TYPES and not (ggml_type == "Q6_K" and batch_dtype() == torch.bfloat16):
        return math.inf
    return FILE_GEMV_ROWS
# Rows above which a product dequantizes to f32 and runs a GEMM: a CPU multiplies one row by
# f16 or packed codes fast (GEMV), a prefill batch faster as an f32 GEMM, conversion included.
UPCAST_ROWS = 32
# The same for Int4, whose kernel stays ahead longer, by its tile width (32: AVX2, 64: AVX-512, whose
# kernel runs about 4x faster): measured break-evens (benchmarks/README.md).
INT4_GEMV_ROWS = {32: 96, 64: 256}


def int4_gemv_rows() -> int:
    """Rows up to which an Int4 product stays on the packed codes (INT4_GEMV_ROWS of this CPU's tile width)."""
    return INT4_GEMV_ROWS.get(tile_width(), 96)


# Rows from which a smaller Int4 batch (a prompt's chunk, the server's prefills) dequantizes slabs of W to bf16
# for a bf16 GEMM where the CPU multiplies bf16 in hardware (kernel_table.BF16: about twice its f32 rate, which the
# int4 kernel does not pass); fewer rows stay with the int4 kernel (benchmarks/README.md). Its activations are bf16
# already.
BF16_ROWS = 40


def warm_up(model, rows: int) -> None:
    """Load decode's product kernel for up to `rows` rows at a time now (from numba's cache; compiled the first time
    on a machine: seconds), where it will run: the kernel of the PRODUCT entry a CPU model's Int4 and Int8 matrices
    chose, if it has one to load, and the FileBlocks kernels."""
    forms = [p for f in model.forms().values() for p in getattr(f, "parts", [f])]
    kinds = {f.kind for f in forms if getattr(f, "kind", None) in ("int4", "int8")}
    loads = {getattr(table.choose(PRODUCT, "cpu", kind).run, "warm_up", None) for kind in kinds} - {None}
    for load_kernel in loads:
        load_kernel(rows)
    file_types = {f.type for f in forms if isinstance(f, FileBlocks)}
    if file_types and table.cpu_compiler():
        _cpu_kernel("ggml_rows").warm_up()
        if any(table.choose(PRODUCT, "cpu", "ggml", ggml_type=t).run is _file_blocks_dot for t in file_types):
            _cpu_kernel("ggml_dot").warm_up()
        if any(isinstance(f, FileTiles) for f in forms):
            _cpu_kernel("ggml_tiles").warm_up()


WEIGHTS = ("native", "f16", "f32")  # --weights choices
_DENSE = {"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


# Output rows dequantized at a time when a batch multiplies an int8 matrix (4096 x 576 f32: 9 MB).
SLAB_ROWS = 4096
# Rows up to which a CUDA product of Blocks runs the Triton kernel on the codes (decode: each row is
# a pass over the decoded tile in registers); a larger batch dequantizes slabs for torch's GEMM.
KERNEL_ROWS = 16
# f32 elements of W an int4 batch product dequantizes at a time (16 MB): a small model's matrices in one
# slab, a large one's in several, into a buffer kept per thread (`_scratch`).
SLAB_ELEMS = 4 << 20
_SCRATCH = threading.local()


def _scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n elements of this thread's reusable buffer of that dtype: a fresh matrix-sized tensor per product would
    cost about as much in page faults as the dequantization into it (benchmarks/README.md)."""
    name = f"buf_{dtype}"
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a plain tensor: written in place in and out of inference mode
            buf = torch.empty(n, dtype=dtype)
            setattr(_SCRATCH, name, buf)
    return buf[:n]


class Dense:
    """W (N, K) as a plain tensor (f16, bf16 or f32): its own product (F.linear, no kernel: not the table's)."""

    kind = "dense"

    def __init__(self, w: torch.Tensor):
        self.w = w

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    @property
    def name(self) -> str:
        return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[self.w.dtype]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if w.dtype == x.dtype or (_rows(x) > UPCAST_ROWS and not w.is_cuda):
            return F.linear(x, w.float() if w.dtype != x.dtype else w)
        return F.linear(x.to(w.dtype), w).float()

    reference_matmul = matmul  # PRODUCT's reference: the product itself

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ROWS' reference: rows start..stop-1 as W.T (K, stop - start) in `dtype`."""
        return self.w[start:stop].T.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids].float()

    def dequantize(self) -> torch.Tensor:
        return self.w.float()

    def narrow(self, start: int, n: int) -> Dense:
        return Dense(self.w[start : start + n])

    def to(self, device) -> Dense:
        return Dense(self.w.to(device))


def tile_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (an index tensor) of packed int4 tiles (..., N_pad, K / 2) -> their codes (*ids.shape, ..., K)
    uint8 0..15: row r lies in tile r // T, byte column (r % T) % (T / 2), the high nibble for the tile's
    second half."""
    T = tile_width()
    lead, K = packed.shape[:-2], 2 * packed.shape[-1]
    j = ids % T
    b = packed.view(*lead, -1, K, T // 2)[..., ids // T, :, j % (T // 2)]  # (*ids.shape, ..., K) bytes
    shift = (4 * (j >= T // 2)).to(torch.uint8)
    return (b >> shift.view(*ids.shape, *[1] * (len(lead) + 1))) & 15


class Int4:
    """W (N, K) = (q - 8) * scale + zero per 32 columns, q 4-bit codes.

    packed (N_pad, K / 2) uint8 in torch's tiled layout (T = tile_width() rows per tile, N padded
    to whole tiles); sz (K / 32, N_pad, 2) bf16 holds scale and zero point, as the op wants them."""

    kind = "int4"
    name = "int4"

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, n: int):
        self.packed, self.sz, self.n = packed, sz, n
        self.operands = None  # kvcli/kernels/cpu/weights.py's views, made at the first product through it
        self.product = None  # its PRODUCT entry's run, chosen at the first product (`matmul`)
        self.slabs = {}  # dtype -> its ROWS entry's run, chosen at the first slab of that dtype (`slab`)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4:
        """codes (N, K) uint8 0..15, scale and zero (N, K / 32) f32 -> the packed form. The tiles are laid
        out here with uint8 ops (int4_tiles.tile_width() checked that torch's packing op lays them so),
        not through that op, which takes int32 codes: 4x the bytes and several times the time."""
        T = tile_width()
        N, K = codes.shape
        pad = -N % T
        if pad:
            codes = torch.cat([codes, codes.new_full((pad, K), 8)])
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        packed = pack_pairs(codes.view(-1, T, K).transpose(1, 2)).reshape(N + pad, K // 2).contiguous()  # (N_pad / T, K, T / 2)
        sz = torch.stack([scale.T, zero.T], -1).bfloat16().contiguous()  # (K / 32, N_pad, 2)
        return cls(packed, sz, N)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, 2 * self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.sz.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        run = self.product
        if run is None:
            run = self.product = table.choose(PRODUCT, self.packed.device.type, self.kind).run
        return run(self, x)

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """PRODUCT's reference: f32 GEMMs over slabs of W dequantized by torch (slab_t)."""
        return _slab_products(self, x, torch.float32, self.slab_t)

    def slab(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop-1 (whole tiles) as W.T (K, stop - start) in `dtype`, through its ROWS entry (chosen once a
        dtype), in the thread's scratch buffer (valid until the next slab)."""
        run = self.slabs.get(dtype)
        if run is None:
            run = self.slabs[dtype] = table.choose(ROWS, self.packed.device.type, self.kind, dtype=dtype).run
        return run(self, start, stop, dtype)

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ROWS' reference (torch): rows start..stop-1 of W (whole tiles) as W.T (K, stop - start) in `dtype`, in the
        thread's scratch buffer. A tile's bytes (K, T / 2) hold its rows j and j + T / 2 in the low and high nibbles,
        so W.T's columns come out of them in order. q s + (z - 8 s) is dequantize's (q - 8) s + z (z - 8 s is exact
        in f32 but for bf16 scale and zero points some 2^16 apart)."""
        T, K, n = tile_width(), self.shape[1], stop - start
        tiles = self.packed[start:stop].view(n // T, K, T // 2).transpose(0, 1)  # (K, n / T, T / 2) bytes
        out = _scratch(K * n).view(K, n // T, 2, T // 2)
        out[:, :, 0].copy_(tiles & 15)
        out[:, :, 1].copy_(tiles >> 4)
        sz = self.sz[:, start:stop].float()  # (K / 32, n, 2)
        scale = sz[..., 0].contiguous()
        zero = sz[..., 1] - 8 * scale
        w = out.view(K // GROUP, GROUP, n)
        torch.addcmul(zero[:, None], w, scale[:, None], out=w)
        if dtype == torch.float32:
            return out.view(K, n)
        return _scratch(K * n, dtype).view(K, n).copy_(out.view(K, n))

    def codes(self) -> torch.Tensor:
        """(N_pad, K) uint8 codes, out of torch's tiles: byte (tile, k, j) holds rows T tile + j and + T / 2."""
        N, half = self.packed.shape
        T = tile_width()
        tiles = unpack_pairs(self.packed.view(N // T, 2 * half, T // 2))  # (N / T, K, T)
        return tiles.transpose(1, 2).reshape(N, 2 * half)

    def dequantize(self) -> torch.Tensor:
        c = self.codes()[: self.n].unflatten(1, (-1, GROUP)).float()  # (N, K / 32, 32)
        sz = self.sz[:, : self.n].float().transpose(0, 1)  # (N, K / 32, 2)
        return ((c - 8) * sz[..., :1] + sz[..., 1:]).flatten(1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (an index tensor of any shape) -> (*ids.shape, K) f32, only those unpacked (a
        Q4_K_M file's token embedding is Q4_K)."""
        c = tile_rows(self.packed, ids)
        sz = self.sz[:, ids].movedim(0, -2).float()  # (*ids.shape, K / 32, 2)
        return ((c.unflatten(-1, (-1, GROUP)).float() - 8) * sz[..., :1] + sz[..., 1:]).flatten(-2)

    def narrow(self, start: int, n: int):
        T = tile_width()
        if start % T or (n % T and start + n != self.n):
            return Rows(self, start, n)
        end = start + n + (-n % T)
        return Int4(self.packed[start:end], self.sz[:, start:end].contiguous(), n)


class Int8:
    """W (N, K) = d q per 32 columns, q int8 codes and d Q8_0's f16 block scales.

    The codes are kept split in two 4-bit halves, q + 128 = 16 h + l, as int4 forms (torch's CPU int4
    GEMV has a fast kernel for bf16 activations; its int8 one takes per-row scales only, so it took one
    call per block): part c (N, 64) holds block c's 32 columns of h with scale 16 d and zero point 8 d, then
    the same columns of l with scale d, so that (h - 8) 16 d + 8 d + (l - 8) d = d q and the part's product
    is [x_c, x_c] @ part.T. The GEMV rounds its output to bf16: one call per part, the partial products
    summed in f32, keeps the logits off bf16's grid (one call over all of K ties the top logits of a head;
    benchmarks/README.md). A block's halves lie side by side in a tile, so that kvcli/kernels/cpu/weights.py reads
    them together as 8-bit codes in one run of memory.
    packed (P, N_pad, 32) uint8 and sz (P, 2, N_pad, 2) bf16: the P = K / 32 parts' Int4 tiles and
    scales, one tensor each (a row's codes come out of every part in one pass); d (N, K / 32) f16 is kept
    for exact rows and dequantize (the token embedding, prefill batches)."""

    kind = "int8"
    name = "int8"

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, n: int, d: torch.Tensor):
        self.packed, self.sz, self.n, self.d = packed, sz, n, d
        self.parts = [Int4(p, z, n) for p, z in zip(packed, sz)]  # views
        self.operands = None  # as Int4's
        self.product = None  # as Int4's

    @classmethod
    def from_codes(cls, q: torch.Tensor, d: torch.Tensor) -> Int8:
        """q (N, K) int8, d (N, K / 32) f16."""
        C = GROUP  # one block a part (see the class)
        u = q.view(torch.uint8) ^ 128  # q + 128
        df = d.float()
        parts = []
        for s in range(0, q.shape[1], C):
            uc, dc = u[:, s : s + C], df[:, s // GROUP : (s + C) // GROUP]
            parts.append(Int4.from_codes(torch.cat([uc >> 4, uc & 15], 1), torch.cat([16 * dc, dc], 1),
                                         torch.cat([8 * dc, torch.zeros_like(dc)], 1)))
        return cls(torch.stack([p.packed for p in parts]), torch.stack([p.sz for p in parts]), q.shape[0], d.half())

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.d.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.sz.numel() + 2 * self.d.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        run = self.product
        if run is None:
            run = self.product = table.choose(PRODUCT, self.packed.device.type, self.kind).run
        return run(self, x)

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """PRODUCT's reference: f32 GEMMs over slabs of SLAB_ROWS rows: never an f32 copy of a whole head (113 MB)."""
        N = self.n
        return torch.cat([F.linear(x, self._slab(s, min(s + SLAB_ROWS, N))) for s in range(0, N, SLAB_ROWS)], -1)

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ROWS' reference: rows start..stop-1 (start on a tile) as W.T (K, stop - start) in `dtype`."""
        return self._slab(start, stop).T.to(dtype)

    def _q(self, c: torch.Tensor) -> torch.Tensor:
        """Codes (..., P, 2 C) of every part -> q (..., K / 32, 32) f32."""
        C = c.shape[-1] // 2
        return (c[..., :C].to(torch.int16) * 16 + c[..., C:] - 128).flatten(-2).unflatten(-1, (-1, GROUP)).float()

    def _slab(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 (start on a tile) -> (stop - start, K) f32."""
        end = min(stop + (-stop % tile_width()), self.packed.shape[1])
        c = torch.stack([Int4(p, z, end - start).codes()[: stop - start]
                         for p, z in zip(self.packed[:, start:end], self.sz)], 1)  # (n, P, 2 C)
        return (self._q(c) * self.d[start:stop].float()[..., None]).flatten(-2)

    def rows(self, ids) -> torch.Tensor:
        """Rows `ids` (an index tensor of any shape) -> (*ids.shape, K) f32: only those rows are dequantized
        (every part's codes in one pass)."""
        ids = torch.as_tensor(ids)
        c = tile_rows(self.packed, ids)  # (*ids.shape, P, 2 C)
        return (self._q(c) * self.d[ids].float()[..., None]).flatten(-2)

    def dequantize(self) -> torch.Tensor:
        return self._slab(0, self.n)

    def narrow(self, start: int, n: int):
        T = tile_width()
        if start % T or (n % T and start + n != self.n):
            return Rows(self, start, n)
        end = start + n + (-n % T)
        return Int8(self.packed[:, start:end], self.sz[:, :, start:end].contiguous(), n, self.d[start : start + n])


class Blocks:
    """W (N, K) = q * scale + min per 32 columns, in the layout of the Triton decode kernel (CUDA):

    bits 4 (Q4_0 / Q4_1 / Q4_K): codes (N, K / 2) uint8, byte 16 b + j of a row holding element
      32 b + j in its low nibble and 32 b + 16 + j in its high one (Q4_0's own order), q 0..15;
      W = (q - 8) d (Q4_0: min -8 d), d q + m (Q4_1), d sc q - dmin m (Q4_K);
    bits 8 (Q8_0): codes (N, K) int8, min None: W = d q.
    scale, min (N, K / 32) f16: Q4_0, Q4_1 and Q8_0 exactly, Q4_K's products d sc, dmin m rounded
    once. Up to KERNEL_ROWS rows multiply the codes on CUDA (kvcli.kernels.gpu.weights); more, and where
    the kernels are off, slabs of W are dequantized to `dtype` for torch's GEMM."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor | None, bits: int,
                 dtype: torch.dtype = torch.float32):
        self.codes, self.scale, self.min, self.bits, self.dtype = codes, scale, min_, bits, dtype
        self.kind = self.name = f"int{bits}_cuda"
        self.product = None  # its PRODUCT entry's run, chosen at the first product

    @classmethod
    def int4(cls, codes: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, dtype=torch.float32) -> Blocks:
        """codes (N, K) uint8 0..15, scale and min (N, K / 32) f16 -> the packed form."""
        c = codes.unflatten(1, (-1, 2, GROUP // 2))  # (N, K / 32, 2, 16): a block's halves
        return cls((c[:, :, 0] | c[:, :, 1] << 4).flatten(1), scale, min_, 4, dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min) if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        run = self.product
        if run is None:
            run = self.product = table.choose(PRODUCT, self.codes.device.type, self.kind).run
        return run(self, x)

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """PRODUCT's reference: slabs of SLAB_ROWS rows dequantized to `dtype` for torch's GEMM."""
        xd = x.to(self.dtype)
        return torch.cat([F.linear(xd, self.rows(slice(s, s + SLAB_ROWS)).to(self.dtype))
                          for s in range(0, self.shape[0], SLAB_ROWS)], -1).float()

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ROWS' reference: rows start..stop-1 as W.T (K, stop - start) in `dtype`."""
        return self.rows(slice(start, stop)).T.to(dtype)

    def rows(self, ids) -> torch.Tensor:
        """Rows `ids` (an index tensor of any shape, or a slice) -> (..., K) f32: only those dequantized."""
        c = self.codes[ids]
        q = unpack_pairs(c.unflatten(-1, (-1, GROUP // 2))) if self.bits == 4 else c.unflatten(-1, (-1, GROUP))
        w = q.float() * self.scale[ids].float()[..., None]  # (..., K / 32, 32)
        return (w if self.min is None else w + self.min[ids].float()[..., None]).flatten(-2)

    def dequantize(self) -> torch.Tensor:
        return self.rows(slice(None))

    def narrow(self, start: int, n: int) -> Blocks:
        part = lambda t: None if t is None else t[start : start + n]
        return Blocks(part(self.codes), part(self.scale), part(self.min), self.bits, self.dtype)

    def to(self, device) -> Blocks:
        move = lambda t: None if t is None else t.to(device)
        return Blocks(move(self.codes), move(self.scale), move(self.min), self.bits, self.dtype)


class FileBlocks:
    """W (N, K) in the file's own ggml blocks: raw (N, K / QK * bytes a block) uint8, read-only, a view of the memory map
    or a copy of it (fused rows), multiplied where it lies by kvcli/kernels/cpu/ggml_rows.py (decode: a slab of rows
    decoded at a time for every row of x; a batch: slabs + GEMM). No byte more than the file's."""

    kind = "ggml"

    def __init__(self, raw: np.ndarray, ggml_type: str, k: int):
        if raw.flags.writeable:  # one compiled kernel a type: every form's bytes typed read-only, as the map's are
            raw.setflags(write=False)
        self.raw, self.type, self.k = raw, ggml_type, k
        self.product = None  # its PRODUCT entry's run, chosen at the first product (`matmul`)

    @property
    def name(self) -> str:
        return self.type.lower()

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        run = self.product
        if run is None:
            run = self.product = table.choose(PRODUCT, "cpu", self.kind, ggml_type=self.type).run
        return run(self, x)

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """PRODUCT's reference: f32 GEMMs over slabs of W dequantized by gguf-py (slab_t)."""
        return _file_slab_products(self, x, self.slab_t)  # f32: the reference

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ROWS' reference (gguf-py's dequantization): rows start..stop-1 as W.T (K, stop - start) in `dtype`."""
        import gguf

        w = gguf.quants.dequantize(self.raw[start:stop], gguf.GGMLQuantizationType[self.type])
        return torch.from_numpy(np.ascontiguousarray(w, np.float32)).T.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (an index tensor of any shape) -> (*ids.shape, K) f32, only those decoded (the embedding)."""
        flat = ids.reshape(-1).numpy().astype(np.int64)
        if table.cpu_compiler():
            out = _cpu_kernel("ggml_rows").dequantize_ids(self.type, self.raw, flat, np.empty((len(flat), self.k),
                                                                                              np.float32))
            return torch.from_numpy(out).view(*ids.shape, self.k)
        return torch.stack([self.slab_t(int(i), int(i) + 1)[:, 0] for i in flat]).view(*ids.shape, self.k)

    def dequantize(self) -> torch.Tensor:
        return self.slab_t(0, self.shape[0]).T.contiguous()

    def narrow(self, start: int, n: int) -> FileBlocks:
        return FileBlocks(self.raw[start : start + n], self.type, self.k)


class FileTiles(FileBlocks):
    """W (N, K) of a 32-element ggml type (TILE_TYPES) in its file's blocks regrouped 8 rows at a time: tiles
    (N / 8, 8 row bytes) uint8, the same bytes in another order (kvcli/kernels/cpu/ggml_tiles.py retile) so that
    decode's AVX2 kernel keeps 8 rows' sums in one vector's lanes. No byte more than the file's; rows and slabs are
    put back in the file's order where read (the embedding, a batch's slabs)."""

    kind = "ggml_tiles"

    def __init__(self, tiles: np.ndarray, ggml_type: str, k: int):
        if tiles.flags.writeable:
            tiles.setflags(write=False)
        self.tiles, self.type, self.k = tiles, ggml_type, k
        self.product = None
        import gguf

        elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
        self.per_tile = tiles.shape[1] // (k // elements * block_bytes)  # rows a tile holds

    @classmethod
    def of(cls, raw: np.ndarray, ggml_type: str, k: int, mapped: bool = False,
           into: np.ndarray | None = None) -> FileTiles:
        """Regrouped from raw (N, row bytes); mapped: raw is a view of the file's memory map, whose pages are let
        go as they are read (they would count in RSS beside the tiles until the load's end); into: the (N / 8,
        8 row bytes) uint8 to write the tiles to (a slice of a fused product's buffer: joined_buffers), else a new
        anonymous map."""
        empty = mapped_empty if into is None else lambda shape, dtype: into
        return cls(_cpu_kernel("ggml_tiles").retile(ggml_type, raw, drop_view_pages if mapped else None, empty),
                   ggml_type, k)

    @property
    def raw(self) -> np.ndarray:
        """The file's blocks (N, row bytes): a copy, for the references and tests."""
        return self.file_rows(0, self.shape[0])

    @property
    def name(self) -> str:
        return f"{self.type.lower()}x8"

    @property
    def shape(self) -> tuple[int, int]:
        return self.tiles.shape[0] * self.per_tile, self.k

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes

    def file_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 in the file's blocks (stop - start, row bytes)."""
        lo, hi = start // self.per_tile, -(-stop // self.per_tile)
        raw = _cpu_kernel("ggml_tiles").untile(self.type, self.tiles, lo, hi)
        return raw[start - self.per_tile * lo : stop - self.per_tile * lo]

    def slab_t(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return FileBlocks(self.file_rows(start, stop), self.type, self.k).slab_t(0, stop - start, dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).numpy().astype(np.int64)
        tiles, at = np.unique(flat // self.per_tile, return_inverse=True)  # only the tiles asked for put back
        raw = np.concatenate([self.file_rows(self.per_tile * t, self.per_tile * t + self.per_tile) for t in tiles])
        picked = FileBlocks(raw, self.type, self.k).rows(torch.from_numpy(self.per_tile * at + flat % self.per_tile))
        return picked.view(*ids.shape, self.k)


class Rows:
    """Rows start..start+n-1 of a form that cannot be sliced in place (a packed tile split)."""

    def __init__(self, form, start: int, n: int):
        self.form, self.start, self.n = form, start, n
        self.kind, self.name, self.nbytes = form.kind, form.name, 0  # a view: its bytes are the form's

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.form.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.form.matmul(x)[..., self.start : self.start + self.n]

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.form.reference_matmul(x)[..., self.start : self.start + self.n]

    def rows(self, ids) -> torch.Tensor:
        return self.dequantize()[ids]

    def dequantize(self) -> torch.Tensor:
        return self.form.dequantize()[self.start : self.start + self.n]

    def narrow(self, start: int, n: int) -> Rows:
        return Rows(self.form, self.start + start, n)


class Concat:
    """Forms stacked along N (fused q/k/v or gate/up whose parts cannot be joined in place)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.kind = self.name = "+".join(sorted({p.name for p in parts}))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], -1)

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.reference_matmul(x) for p in self.parts], -1)

    def rows(self, ids) -> torch.Tensor:
        return self.dequantize()[ids]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def narrow(self, start: int, n: int):
        ends = [0]
        for p in self.parts:
            ends.append(ends[-1] + p.shape[0])
        if start in ends and start + n in ends:  # whole parts
            i, j = ends.index(start), ends.index(start + n)
            return self.parts[i] if j == i + 1 else Concat(self.parts[i:j])
        return Rows(self, start, n)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """numpy arrays stacked along their first axis: a view where they lie one after another in one buffer (the
    tiles of a fused product written into joined_buffers' slices), else a copy into an anonymous map
    (memory.mapped_empty: a load's copy)."""
    view = _adjacent_view(arrays)
    if view is not None:
        return view
    out = mapped_empty((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
    return np.concatenate(arrays, out=out)


def _adjacent_view(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The arrays (C-contiguous, one row width and dtype) as one view of the one flat array they all slice, where
    each starts where the one before ends; else None."""
    roots = []
    for a in arrays:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        roots.append(root)
    first = arrays[0]
    if (any(r is not roots[0] for r in roots) or isinstance(roots[0], np.memmap)  # the file's map: its blocks copied
            or roots[0].ndim != 1 or not roots[0].flags.c_contiguous
            or any(not a.flags.c_contiguous or a.shape[1:] != first.shape[1:] or a.dtype != first.dtype
                   for a in arrays)):
        return None
    at = [a.__array_interface__["data"][0] for a in arrays]
    if any(at[i] + arrays[i].nbytes != at[i + 1] for i in range(len(arrays) - 1)):
        return None
    root = roots[0]
    start = (at[0] - root.__array_interface__["data"][0]) // root.itemsize
    count = sum(a.size for a in arrays)
    return root[start : start + count].view(first.dtype).reshape(-1, *first.shape[1:])


def joined_buffers(tensors: dict, groups: list[tuple[str, ...]], forms: dict) -> dict[str, np.ndarray]:
    """For each group of matrices that one product takes fused (a layer's q, k, v; gate, up) whose forms are the
    same FileTiles type: one anonymous map for all their tiles, and each matrix's slice of it by name, for its
    retile to write to. cat then joins them as a view of that map: no second copy of the layer's bytes (a load's
    time, and its peak)."""
    out = {}
    for names in groups:
        kinds = {forms.get(n) for n in names}
        if len(kinds) != 1 or not str(next(iter(kinds))).endswith("x8"):
            continue
        ts = [tensors[n] for n in names]
        if len({int(t.shape[0]) for t in ts}) != 1:
            continue
        rows = _cpu_kernel("vectors").TILE_ROWS
        shapes = [(matrix_rows(t) // rows, int(t.n_bytes) // matrix_rows(t) * rows) for t in ts]
        flat = mapped_empty((sum(a * b for a, b in shapes),), np.uint8)
        at = 0
        for n, (tiles, width) in zip(names, shapes):
            out[n] = flat[at : at + tiles * width].reshape(tiles, width)
            at += tiles * width
    return out


def cat(forms: list):
    """Forms stacked along N as one form: in place where all are Dense of one dtype, Int8, Blocks of
    one kind, or Int4 of whole tiles (one product for fused q/k/v and gate/up); a Concat of separate
    products otherwise."""
    kinds = {type(f) for f in forms}
    if kinds == {Dense} and len({f.w.dtype for f in forms}) == 1:
        return Dense(torch.cat([f.w for f in forms]))
    if kinds == {Int8}:
        if all(f.n == f.packed.shape[1] for f in forms[:-1]) and len({f.packed.shape[2] for f in forms}) == 1:
            return Int8(torch.cat([f.packed for f in forms], 1), torch.cat([f.sz for f in forms], 2),
                        sum(f.n for f in forms), torch.cat([f.d for f in forms]))
    if kinds == {Blocks} and len({(f.bits, f.min is None, f.dtype) for f in forms}) == 1:
        join = lambda ts: None if ts[0] is None else torch.cat(ts)
        return Blocks(join([f.codes for f in forms]), join([f.scale for f in forms]), join([f.min for f in forms]),
                      forms[0].bits, forms[0].dtype)
    if kinds == {FileBlocks} and len({(f.type, f.k) for f in forms}) == 1:  # one copy of the layer's rows
        return FileBlocks(_joined([f.raw for f in forms]), forms[0].type, forms[0].k)
    if kinds == {FileTiles} and len({(f.type, f.k) for f in forms}) == 1:
        return FileTiles(_joined([f.tiles for f in forms]), forms[0].type, forms[0].k)
    if kinds == {Int4} and all(f.n == f.packed.shape[0] for f in forms[:-1]):
        return Int4(torch.cat([f.packed for f in forms]), torch.cat([f.sz for f in forms], 1),
                    sum(f.n for f in forms))
    return Concat(list(forms))


# ---- from the GGUF file ----

# ggml types kept in their own blocks on the CPU (FileBlocks); their sizes are gguf-py's GGML_QUANT_SIZES
FILE_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def resident_form(ggml_type: str, weights: str, dtype: str, device: str, n: int | None = None) -> str:
    """The form a matrix of `ggml_type` is kept in: 'int4', 'int8' (CPU), 'int4_cuda', 'int8_cuda'
    (CUDA: Blocks), the type's name in lower case (CPU: FileBlocks, the file's own bytes), or a dense dtype name.

    weights: native (on the CPU: where ggml_tiles' AVX2 kernel runs (AVX-512 CPUs too), its types as 8 rows' blocks
    regrouped ('q5_0x8', FileTiles) when the matrix's n rows (None: any) are whole tiles: the file's bytes, and on the
    AVX-512 EPYC measured 1.4-1.9x the decode of the int4 / int8 forms with the VNNI kernel; else the file's blocks
    where the AVX2 byte-product kernel takes the type; else Q4_0, Q4_1, Q4_K as int4 tiles for torch's GEMV; the
    other types FILE_BLOCKS lists in the file's blocks; CUDA: Blocks for the Triton kernel; else dense at the compute
    dtype), f16, f32."""
    if weights != "native":
        return weights
    if device == "cuda" and ggml_type in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):
        return "int8_cuda" if ggml_type == "Q8_0" else "int4_cuda"
    if device == "cpu" and tile_width() is not None and ggml_type in ("Q4_0", "Q4_1", "Q4_K"):
        if table.choose(PRODUCT, "cpu", "ggml", ggml_type=ggml_type).run is not _file_blocks_dot:
            return "int4"
    if device == "cpu" and ggml_type in _tile_types() and (n is None or n % 8 == 0):
        return f"{ggml_type.lower()}x8"
    if device == "cpu" and ggml_type in FILE_BLOCKS:
        return ggml_type.lower()
    return dtype


def matrix_rows(tensor) -> int:
    """A GGUF matrix's row count N (its dims after the first, which is K)."""
    return int(np.prod([int(s) for s in tensor.shape[1:]]))


def tensor_form(tensors: dict, name: str, weights: str, dtype: str, device: str) -> str:
    """resident_form of the GGUF matrix `name` among `tensors` (name -> tensor): an embedding only looked up (the
    file has its own output.weight) stays in the file's blocks, a view of the map whose pages are read only for the
    tokens met, rather than regrouped (a copy of every row) for products it never takes."""
    t = tensors[name]
    form = resident_form(t.tensor_type.name, weights, dtype, device, matrix_rows(t))
    if name == "token_embd.weight" and "output.weight" in tensors:
        return form.removesuffix("x8")
    return form


def resident_bytes(form: str, n: int, k: int) -> int:
    """Bytes an (n, k) matrix takes in `form`, as the form classes hold it."""
    if form == "int4":
        n_pad = n + (-n % (tile_width() or 1))
        return n_pad * k // 2 + n_pad * (k // GROUP) * 4
    if form == "int8":  # int4 forms of (n, 2k) in all, and the f16 scales
        return resident_bytes("int4", n, 2 * k) + n * (k // GROUP) * 2
    if form == "int4_cuda":  # codes, f16 scale and min
        return n * k // 2 + n * (k // GROUP) * 4
    if form == "int8_cuda":  # codes, f16 scale
        return n * k + n * (k // GROUP) * 2
    if form.upper().removesuffix("X8") in FILE_BLOCKS:  # the file's own blocks (x8: 8 rows' regrouped, as many)
        import gguf

        elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[form.upper().removesuffix("X8")]]
        return n * k // elements * block_bytes
    return n * k * _DENSE[form].itemsize


# ggml block layouts as numpy records (gguf-py's quants read them so too); Q4_K's super-blocks
# hold 256 elements, the others 32.
_RECORDS = {"Q4_0": [("d", "<f2"), ("qs", "u1", 16)], "Q4_1": [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)],
            "Q8_0": [("d", "<f2"), ("qs", "i1", 32)],
            "Q4_K": [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]}


def _blocks(tensor) -> np.ndarray:
    """A quantized tensor's bytes as (N, K / block) records over the memory map (no copy)."""
    return np.asarray(tensor.data).reshape(-1).view(np.dtype(_RECORDS[tensor.tensor_type.name])) \
        .reshape(matrix_rows(tensor), -1)


# Byte offsets of the f16 fields (d, and m or dmin) in each FileBlocks type's block (ggml-common.h).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _check_file_scales(name: str, raw: np.ndarray, ggml_type: str, tiled: bool = False) -> None:
    """Refuse a FileBlocks tensor with a NaN/Inf f16 field: its exponent bits all ones (bits 2-6 of the high byte),
    read in place from the map (no copy of the blocks); tiled: raw is FileTiles' (a field's 8 rows in its unit's
    16 bytes), read there once made, so the map's pages are read once, by the regrouping, a run at a time."""
    import gguf

    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][1]
    if tiled:
        blocks = raw.reshape(-1, 8 * block_bytes)
        places = [2 * _cpu_kernel("ggml_tiles").unit_place(ggml_type, at // 2) for at in F16_FIELDS[ggml_type]]
        highs = [blocks[:, p + 1 : p + 16 : 2] for p in places]  # the 8 rows' high bytes of a field's unit
    else:
        blocks = raw.reshape(-1, block_bytes)
        highs = [blocks[:, at + 1] for at in F16_FIELDS[ggml_type]]
    if any(((h & 0x7C) == 0x7C).any() for h in highs):
        from kvcli.errors import KvcliError

        raise KvcliError(f"tensor {name} holds NaN/Inf block scales; the model file is corrupt")


def _check_finite(name: str, *scales: torch.Tensor) -> None:
    from kvcli.errors import KvcliError

    for s in scales:
        if not torch.isfinite(s).all():  # a NaN scale would poison every logit, silently
            raise KvcliError(f"tensor {name} holds NaN/Inf block scales; the model file is corrupt")


def _q4_k(name: str, b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (N, K / 256) -> codes (N, K) uint8 0..15, scale and min (N, K / 32) f32.

    A super-block: f16 d and dmin, 12 bytes of 6-bit scales sc and mins m for its 8 sub-blocks of
    32, 128 bytes of codes (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c + 1 in the
    high); w = d sc q - dmin m: scale d sc, min -dmin m (llama.cpp's dequantize_row_q4_K)."""
    N = len(b)
    d, dmin = (torch.from_numpy(b[f].astype(np.float32)) for f in ("d", "dmin"))  # (N, K / 256)
    _check_finite(name, d, dmin)
    # get_scale_min_k4: bytes 0-3 hold sc 0-3 in their low 6 bits, bytes 4-7 m 0-3; bytes 8-11 the
    # low 4 bits of sc 4-7 (low nibble) and m 4-7 (high), whose top 2 bits are those of bytes 0-3 / 4-7.
    s = b["scales"]  # (N, K / 256, 12)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.from_numpy(np.concatenate([lo & 63, (hi & 15) | (lo >> 6) << 4], -1).astype(np.float32))
    m = torch.from_numpy(np.concatenate([mid & 63, (hi >> 4) | (mid >> 6) << 4], -1).astype(np.float32))
    scale = (d[..., None] * sc).view(N, -1)  # (N, K / 32), exact in f32 (11-bit d times 6-bit sc)
    min_ = -(dmin[..., None] * m).view(N, -1)
    qs = b["qs"].reshape(N, -1, 4, 32)  # a view over the file
    codes = np.empty((N, qs.shape[1], 4, 2, 32), np.uint8)  # the one copy: no nibble temporaries
    np.bitwise_and(qs, 15, out=codes[..., 0, :])
    np.right_shift(qs, 4, out=codes[..., 1, :])
    return torch.from_numpy(codes.reshape(N, -1)), scale, min_


def _half(name: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    """f32 scales -> f16 (Blocks'), refusing any that f16 cannot hold (it would turn them to Inf)."""
    from kvcli.errors import KvcliError

    out = [t.half() for t in ts]
    if not all(torch.isfinite(t).all() for t in out):
        raise KvcliError(f"tensor {name} has block scales beyond f16's range, which the CUDA form keeps; "
                         f"load it with --weights f32")
    return out


def random_int4(form: str, n: int, k: int, generator: torch.Generator, dtype: str = "f32", std: float = 0.02):
    """A random (n, k) matrix in form 'int4' or 'int4_cuda' (a synthetic model's, made on the generator's
    device): uniform random bytes (uniform codes in any layout: no packing), one scale s and a zero
    point centring them, W uniform over 16 levels (q - 7.5) s of mean 0 and standard deviation `std`."""
    s = std / (255 / 12) ** 0.5  # the standard deviation of q - 7.5, q uniform 0..15
    dev = generator.device
    if form == "int4":
        n_pad = n + (-n % tile_width())
        packed = torch.randint(0, 256, (n_pad, k // 2), generator=generator, dtype=torch.uint8, device=dev)
        sz = torch.tensor([s, s / 2]).bfloat16().expand(k // GROUP, n_pad, 2).contiguous()  # (q - 8) s + s / 2
        return Int4(packed, sz, n)
    codes = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8, device=dev)
    scale = torch.full((n, k // GROUP), s, dtype=torch.float16, device=dev)
    return Blocks(codes, scale, -7.5 * scale, 4, _DENSE[dtype])


def random_q4_0(n: int, k: int, generator: torch.Generator, form: str = "q4_0", std: float = 0.02) -> FileBlocks:
    """A random (n, k) Q4_0 matrix in the file's blocks (a synthetic model's on a CPU that keeps Q4_0 so; form q4_0x8:
    regrouped as FileTiles): uniform random code bytes, every block's f16 d = s, W = (q - 8) s of standard deviation
    about `std`."""
    s = std / (255 / 12 + 0.25) ** 0.5  # q - 8, q uniform 0..15: mean -0.5, mean square 255 / 12 + 0.25
    raw = torch.randint(0, 256, (n, k // 32, 18), generator=generator, dtype=torch.uint8).numpy()
    raw[..., :2] = np.array([s], np.float16).view(np.uint8)
    if form == "q4_0x8":
        return FileTiles.of(raw.reshape(n, -1), "Q4_0", k)
    return FileBlocks(raw.reshape(n, -1), "Q4_0", k)


def load(tensor, form: str, dtype: str = "f32", into: np.ndarray | None = None):
    """A gguf.ReaderTensor (over the memory map) -> its resident form, holding one tensor's copy at most.
    dtype: the GEMM dtype of Blocks' batches (the compute dtype); into: where a FileTiles form's tiles go
    (joined_buffers), else a new map.

    ggml blocks of 32: Q4_0 = f16 d, 16 bytes of codes (element j in the low nibble of byte j,
    j + 16 in the high one), w = d (q - 8); Q4_1 = f16 d, f16 m, 16 bytes, w = d q + m =
    d (q - 8) + (m + 8 d); Q8_0 = f16 d, 32 int8, w = d q. Q4_K: see _q4_k."""
    from kvcli.gguf_file import dequantize

    if form in ("int4", "int4_cuda") and tensor.tensor_type.name == "Q4_K":
        codes, scale, min_ = _q4_k(tensor.name, _blocks(tensor))
        if form == "int4":
            return Int4.from_codes(codes, scale, 8 * scale + min_)  # zero point of (q - 8): min + 8 scale
        return Blocks.int4(codes, *_half(tensor.name, scale, min_), _DENSE[dtype])
    if form in ("int4", "int8", "int4_cuda", "int8_cuda"):
        b = _blocks(tensor)
        d = torch.from_numpy(b["d"].astype(np.float32))  # (N, K / 32)
        m = torch.from_numpy(b["m"].astype(np.float32)) if "m" in b.dtype.names else None  # Q4_1's min
        _check_finite(tensor.name, d, *([] if m is None else [m]))
    if form == "int4_cuda":  # Q4_0 / Q4_1's codes are already in Blocks' order: one copy
        codes = torch.from_numpy(np.ascontiguousarray(b["qs"]).reshape(len(b), -1))  # (N, K / 2)
        return Blocks(codes, *_half(tensor.name, d, -8 * d if m is None else m), 4, _DENSE[dtype])
    if form == "int8_cuda":
        codes = torch.from_numpy(np.ascontiguousarray(b["qs"]).reshape(len(b), -1))  # (N, K) int8
        return Blocks(codes, d.half(), None, 8, _DENSE[dtype])
    if form == "int4":
        qs = b["qs"]  # (N, K / 32, 16): element j in the low nibble of byte j, j + 16 in the high one
        codes = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], -1).reshape(len(qs), -1))  # (N, K) 0..15
        return Int4.from_codes(codes, d, torch.zeros_like(d) if m is None else m + 8 * d)
    if form == "int8":
        # a slab of rows at a time (the split halves take 2 bytes a weight); SLAB_ROWS is whole tiles,
        # so the slabs join in place
        return cat([Int8.from_codes(torch.from_numpy(np.ascontiguousarray(b["qs"][s : s + SLAB_ROWS])).flatten(1),
                                    d[s : s + SLAB_ROWS]) for s in range(0, len(b), SLAB_ROWS)])
    n, k = matrix_rows(tensor), int(tensor.shape[0])
    if form.upper().removesuffix("X8") in FILE_BLOCKS:  # the memory map's bytes as they lie: no copy, nothing decoded
        raw = np.asarray(tensor.data).reshape(n, -1)
        if form.endswith("x8"):  # 8 rows' blocks regrouped for the AVX2 decode kernel: a copy
            tiles = FileTiles.of(raw, tensor.tensor_type.name, k, mapped=True, into=into)
            _check_file_scales(tensor.name, tiles.tiles, tensor.tensor_type.name, tiled=True)
            return tiles
        _check_file_scales(tensor.name, raw, tensor.tensor_type.name)
        return FileBlocks(raw, tensor.tensor_type.name, k)
    w = torch.empty(n, k, dtype=_DENSE[form])
    for s in range(0, n, SLAB_ROWS):  # a slab of rows in f32 at a time: peak = the result plus one slab
        w[s : s + SLAB_ROWS] = torch.from_numpy(dequantize(tensor, s, s + SLAB_ROWS))
    return Dense(w)


# ---- the kernel table's entries for the weights' roles (kvcli/kernel_table.py: PRODUCT, ROWS, NORM) ----
# PRODUCT: run(form, x (..., K) f32) -> (..., N) f32, keyed by the form's kind; ROWS: run(form, start, stop, dtype) ->
# W.T's slab (K, stop - start), keyed by the kind, `dtype` its shape; NORM: run(x, weight, eps), keyed by the dtype's
# name. The row thresholds above are the entries' own: each entry takes every row count, and picks its path by them.

@functools.cache
def _cpu_kernel(name: str):
    """A CPU kernel module, imported where it first runs (numba loads only there)."""
    return importlib.import_module(f"kvcli.kernels.cpu.{name}")


def _int4_tiles_ready() -> bool:
    """torch's CPU int4 GEMM is there and packs its tiles as kvcli lays them (int4_tiles.tile_width())."""
    return tile_width() is not None


def _vnni_ready() -> bool:
    """numba, and tiles the int8-dot kernel reads (T = 32, 64)."""
    return _int4_tiles_ready() and table.cpu_compiler() and _cpu_kernel("weights").covers(tile_width())


def _triton_ready() -> bool:
    return importlib.util.find_spec("triton") is not None


def _slab_products(form: Int4, x: torch.Tensor, dtype: torch.dtype, slab=None) -> torch.Tensor:
    """x @ W.T for an Int4 form by slabs of W dequantized (to `dtype`, x's; slab(start, stop, dtype) -> W.T's slab,
    the form's ROWS entry unless given), each product taken before the next slab reuses the scratch."""
    slab = slab or form.slab
    T = tile_width()
    Np, K = form.packed.shape[0], form.shape[1]
    step = max(T, SLAB_ELEMS // K // T * T)
    parts = [x @ slab(s, min(s + step, Np), dtype) for s in range(0, Np, step)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # one slab: no copy
    return y if Np == form.n else y[..., : form.n].contiguous()


def batch_dtype() -> torch.dtype:
    """The GEMM dtype of a file form's batch (more than FILE_GEMV_ROWS rows): bf16 where the CPU multiplies bf16 in
    hardware (kernel_table.BF16: x and the slab rounded to bf16, f32 sums, the output rounded to bf16; 2.5x the f32
    GEMM's rate on the AVX-512 EPYC, Qwen's pp512 1.5x; its KLD against --weights f32 in benchmarks/README.md),
    else f32."""
    return torch.bfloat16 if table.has(BF16) else torch.float32


def _file_slab_products(form: FileBlocks, x: torch.Tensor, slab, rows_a_step: int = 1,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ W.T (f32) for a FileBlocks form by slabs of W in `dtype` (slab(start, stop, dtype) -> W.T's slab (K, stop -
    start)), x rounded to dtype, each product taken before the next slab (which may reuse the scratch); slabs a
    multiple of rows_a_step rows."""
    N, K = form.shape
    step = max(rows_a_step, SLAB_ELEMS // K // rows_a_step * rows_a_step)
    xd = x.to(dtype)
    if step >= N:
        return (xd @ slab(0, N, dtype)).float()
    y = x.new_empty(*x.shape[:-1], N, dtype=torch.float32)  # each slab's product lands in place (f32), no concat
    for s in range(0, N, step):
        y[..., s : min(s + step, N)] = xd @ slab(s, min(s + step, N), dtype)
    return y


def _file_slab(form: FileBlocks, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ROWS for FileBlocks: rows start..stop-1 decoded by the type's kernel into the thread's scratch, as W.T (another
    dtype: rounded into that dtype's scratch)."""
    n = form.k * (stop - start)
    out = _scratch(n).view(stop - start, form.k)
    _cpu_kernel("ggml_rows").dequantize(form.type, form.raw, start, stop, out.numpy())
    return out.T if dtype == torch.float32 else _scratch(n, dtype).view(stop - start, form.k).copy_(out).T


def _file_blocks_product(kernel: str):
    """PRODUCT's run for FileBlocks through the kernel module `kernel` (ggml_rows: f32 slabs in the core's cache;
    ggml_dot: AVX2 integer products): up to FILE_GEMV_ROWS rows on the blocks (its matmul), a batch by slabs + GEMM
    (batch_dtype)."""

    def run(form: FileBlocks, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows > FILE_GEMV_ROWS:
            return _file_slab_products(form, x, functools.partial(_file_slab, form), dtype=batch_dtype())
        y = _cpu_kernel(kernel).matmul(form.type, form.raw, x.reshape(rows, form.k).contiguous().numpy())
        return torch.from_numpy(y).view(*x.shape[:-1], y.shape[1])

    return run


_file_blocks_numba, _file_blocks_dot = _file_blocks_product("ggml_rows"), _file_blocks_product("ggml_dot")


def _dot_types() -> tuple[str, ...]:
    return _cpu_kernel("vectors").DOT_TYPES if table.cpu_compiler() else ()


def _tile_types() -> tuple[str, ...]:
    """The types kept as FileTiles: those of ggml_tiles' kernel, where the CPU runs it."""
    if not table.cpu_compiler() or table.choose(PRODUCT, "cpu", "ggml_tiles").run is not _file_tiles_dot:
        return ()
    return _cpu_kernel("vectors").TILE_TYPES


def _tiles_slab(form: FileTiles, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ROWS for FileTiles: whole tiles put back and decoded in one pass into the thread's scratch of `dtype` (f32 or
    bf16: ggml_tiles.decoded), as W.T; other rows put back in the file's order, then decoded as FileBlocks'."""
    if start % form.per_tile or stop % form.per_tile or dtype not in (torch.float32, torch.bfloat16):
        return _file_slab(FileBlocks(form.file_rows(start, stop), form.type, form.k), 0, stop - start, dtype)
    out = _scratch(form.k * (stop - start), dtype).view(stop - start, form.k)
    _cpu_kernel("ggml_tiles").decoded(form.type, form.tiles, start // form.per_tile, stop // form.per_tile,
                                      (out if dtype == torch.float32 else out.view(torch.int16)).numpy())
    return out.T


def _file_tiles_dot(form: FileTiles, x: torch.Tensor) -> torch.Tensor:
    """PRODUCT's run for FileTiles: up to tiles_kernel_rows(its type) rows by ggml_tiles' kernel, a larger batch by
    slabs + GEMM (batch_dtype)."""
    rows = _rows(x)
    if rows > FILE_GEMV_ROWS and rows > tiles_kernel_rows(form.type):  # decode's rows never ask the table
        return _file_slab_products(form, x, functools.partial(_tiles_slab, form), form.per_tile, batch_dtype())
    y = _cpu_kernel("ggml_tiles").matmul(form.type, form.tiles, x.reshape(rows, form.k).contiguous().numpy())
    return torch.from_numpy(y).view(*x.shape[:-1], y.shape[1])


def _int4_batch(form: Int4, x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A batch's product by slabs: f32 above int4_gemv_rows(), bf16 from BF16_ROWS where the CPU multiplies bf16 in
    hardware; None for fewer rows (the packed codes' product)."""
    if rows > int4_gemv_rows():  # f32 GEMMs over slabs of W dequantized, W.T's layout (a GEMM takes it as is)
        return _slab_products(form, x, torch.float32)
    if rows >= BF16_ROWS and table.has(BF16):
        return _slab_products(form, x.bfloat16(), torch.bfloat16).float()
    return None


def _int4_gemv(form: Int4, x: torch.Tensor) -> torch.Tensor:
    """torch's int4 GEMV on the packed tiles (bf16 activations and output, f32 sums)."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).bfloat16(), form.packed, GROUP, form.sz)
    if y.shape[1] != form.n:  # padding rows of the last tile
        y = y[:, : form.n]
    return y.float().view(*x.shape[:-1], form.n)


def _int8_gemv(form: Int8, x: torch.Tensor) -> torch.Tensor:
    """torch's int4 GEMV once a part ([x_c, x_c] for every part c in one copy: (P, M, 2 C), each part's operand
    contiguous), every part's product summed in f32 as it is made."""
    N = form.n
    P, _, C = form.packed.shape
    M = _rows(x)
    x2 = x.reshape(M, P, 1, C).expand(M, P, 2, C).permute(1, 0, 2, 3).reshape(P, M, 2 * C).bfloat16()
    out = None
    for xc, p in zip(x2, form.parts):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, p.packed, GROUP, p.sz)
        out = y.float() if out is None else out.add_(y)
    if out.shape[1] != N:  # padding rows of the last tile
        out = out[:, :N]
    return out.view(*x.shape[:-1], N)


def _vnni(form, x: torch.Tensor, rows: int) -> torch.Tensor:
    """kvcli/kernels/cpu/weights.py's product over an Int4's codes or an Int8's (its parts' halves as 8-bit codes),
    on views of them made at the first call."""
    ops = form.operands
    if ops is None:
        kernel = _cpu_kernel("weights")
        if isinstance(form, Int8):
            ops = form.operands = kernel.Operands(form.packed, form.sz, tile_width(), doubled=True)
        else:
            ops = form.operands = kernel.Operands(form.packed[None], form.sz[None], tile_width())
    N = form.n
    y = ops.matmul((x if x.dim() == 2 else x.reshape(rows, x.shape[-1])).float())  # (rows, N_pad)
    if y.shape[1] != N:  # padding rows of the last tile
        y = y[:, :N]
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)


def _vnni_warm_up(rows: int) -> None:
    kernel = _cpu_kernel("weights")
    kernel.warm_up(min(rows, kernel.MAX_ROWS))


def _int4_avx512(form: Int4, x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    y = _int4_batch(form, x, rows)
    if y is not None:
        return y
    if rows <= _cpu_kernel("weights").MAX_ROWS:
        return _vnni(form, x, rows)
    return _int4_gemv(form, x)


def _int4_portable(form: Int4, x: torch.Tensor) -> torch.Tensor:
    y = _int4_batch(form, x, _rows(x))
    return _int4_gemv(form, x) if y is None else y


def _int8_avx512(form: Int8, x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    if rows > UPCAST_ROWS:  # f32 GEMM over slabs of rows
        return form.reference_matmul(x)
    if rows <= _cpu_kernel("weights").MAX_ROWS:
        return _vnni(form, x, rows)
    return _int8_gemv(form, x)


def _int8_portable(form: Int8, x: torch.Tensor) -> torch.Tensor:
    return form.reference_matmul(x) if _rows(x) > UPCAST_ROWS else _int8_gemv(form, x)


_int4_avx512.warm_up = _int8_avx512.warm_up = _vnni_warm_up  # the kernel `warm_up` loads


def _blocks_triton(form: Blocks, x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on the codes up to KERNEL_ROWS rows (CUDA, or CPU tensors under TRITON_INTERPRET=1), the
    reference's slabs beyond."""
    if _rows(x) > KERNEL_ROWS:
        return form.reference_matmul(x)
    from kvcli.kernels.gpu.weights import weight_matmul  # imports triton: only where kernels run

    N, K = form.shape
    y = weight_matmul(x.reshape(-1, K), form.codes, form.scale, form.min, form.bits)
    return y.view(*x.shape[:-1], N)


def _int4_slab_bf16(form: Int4, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    K, n = form.shape[1], stop - start
    return _cpu_kernel("dequantize").slab_bf16_t(form.packed, form.sz, start, stop, tile_width(),
                                                 _scratch(K * n, torch.bfloat16))


def _norm_numba(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.from_numpy(_cpu_kernel("norm").norm(x.contiguous().numpy(), weight.numpy(), np.float32(eps)))


def compiled_decode_parts() -> bool:
    """Do the CPU's RMSNorm (f32) and the tiled forms' product run the compiled functions the compiled decode layer
    calls (kvcli/decode_layer.py)?"""
    return (table.choose(NORM, "cpu", "float32").run is _norm_numba
            and table.choose(PRODUCT, "cpu", "ggml_tiles").run is _file_tiles_dot)


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_VNNI = "kvcli/kernels/cpu/weights.py (AVX512-VNNI byte dots) to 8 rows, "
# The CPU products' arithmetic against the reference's f32 slabs (Entry.tol): bf16 activations, outputs and scales
# (torch's int4 GEMV, bf16 slabs, Int8's parts), relative to the output's scale.
BF16_TOL = 1e-2
# 15-bit activations (the byte-product kernels): x within 2^-16 of its 32-column block's largest |x|
DOT_TOL = 1e-4
for _entry in (
    Entry(PRODUCT, "cpu", frozenset({"int4"}), _VNNI + "torch's int4 GEMV, then slabs + GEMM", _int4_avx512,
          isa=AVX512, ready=_vnni_ready, tol=BF16_TOL,
          why="decode's rows on the codes with 15-bit activations: rows cost less than torch's GEMV's"),
    Entry(PRODUCT, "cpu", frozenset({"int8"}), _VNNI + "torch's int4 GEMV a part, then f32 slabs + GEMM",
          _int8_avx512, isa=AVX512, ready=_vnni_ready, tol=BF16_TOL,
          why="decode's rows on the 8-bit codes in one pass (torch: one GEMV call a 32-column part)"),
    Entry(PRODUCT, "cpu", frozenset({"int4"}), "kvcli/weights.py: torch's int4 GEMV, then slabs + GEMM", _int4_portable,
          ready=_int4_tiles_ready, tol=BF16_TOL, why="the packed codes read as they lie, with no kernel of kvcli's"),
    Entry(PRODUCT, "cpu", frozenset({"int8"}), "kvcli/weights.py: torch's int4 GEMV a part, then f32 slabs + GEMM",
          _int8_portable, ready=_int4_tiles_ready, tol=BF16_TOL,
          why="the packed codes read as they lie, with no kernel of kvcli's"),
    Entry(PRODUCT, "cpu", frozenset({"ggml"}), "kvcli/kernels/cpu/ggml_dot.py (AVX2 byte products, 15-bit "
          "activations) to FILE_GEMV_ROWS rows, then slabs + GEMM (bf16 where BF16 runs)", _file_blocks_dot, isa=AVX2,
          covers=lambda ggml_type=None, **_: ggml_type in _dot_types(), ready=table.cpu_compiler, tol=DOT_TOL,
          why="decode's rows on the codes, 32 a product in byte lanes (the slab kernel widens each to f32)"),
    Entry(PRODUCT, "cpu", frozenset({"ggml_tiles"}), "kvcli/kernels/cpu/ggml_tiles.py (AVX2 byte products, 8 rows "
          "a vector, 15-bit activations, the K-quants' 8-bit) to FILE_GEMV_ROWS rows (the K-quants: "
          "tiles_kernel_rows), then slabs + GEMM (bf16 where BF16 runs)", _file_tiles_dot, isa=AVX2,
          ready=table.cpu_compiler, tol=DOT_TOL,
          why="decode's rows on the codes with 8 rows' sums in one vector: scales, conversions and sums once for 8"),
    Entry(PRODUCT, "cpu", frozenset({"ggml"}), "kvcli/kernels/cpu/ggml_rows.py (numba, LLVM vectors) to "
          "FILE_GEMV_ROWS rows, then slabs + GEMM (bf16 where BF16 runs)", _file_blocks_numba, ready=table.cpu_compiler,
          why="the file's blocks decoded a slab of rows at a time, in the core's cache, for every row of x"),
    Entry(ROWS, "cpu", frozenset({"ggml_tiles"}), "kvcli/kernels/cpu/ggml_tiles.py untile, then ggml_rows.py",
          _tiles_slab, covers=lambda dtype=None, **_: dtype == torch.float32, ready=table.cpu_compiler,
          why="the tiles' rows put back in the file's order in one pass, then decoded as the file's blocks"),
    Entry(ROWS, "cpu", frozenset({"ggml"}), "kvcli/kernels/cpu/ggml_rows.py (numba, LLVM vectors)", _file_slab,
          covers=lambda dtype=None, **_: dtype == torch.float32, ready=table.cpu_compiler,
          why="one pass over the blocks where gguf-py's numpy takes several"),
    Entry(PRODUCT, "cuda", frozenset({"int4_cuda", "int8_cuda"}),
          "kvcli/kernels/gpu/weights.py (Triton) to KERNEL_ROWS rows, then slabs + GEMM", _blocks_triton,
          ready=_triton_ready, why="decode: each tile of codes decoded once in registers for every row"),
    Entry(ROWS, "cpu", frozenset({"int4"}), "kvcli/kernels/cpu/dequantize.py (numba, one pass to bf16)",
          _int4_slab_bf16, covers=lambda dtype=None, **_: dtype == torch.bfloat16, ready=table.cpu_compiler,
          why="one pass where torch takes four, torch's bits"),
    Entry(NORM, "cpu", frozenset({"float32"}), "kvcli/kernels/cpu/norm.py (numba, one pass a row)", _norm_numba,
          ready=table.cpu_compiler, why="one call where torch's takes several ops (decode's rows: about half torch's time)"),
):
    table.register(_entry)
table.register(Entry(PRODUCT, "any", frozenset(), "kvcli/weights.py: the form's reference_matmul (slabs + torch GEMM)",
                     lambda form, x: form.reference_matmul(x)), reference=True)
table.register(Entry(ROWS, "any", frozenset(), "kvcli/weights.py: the form's slab_t (torch ops)",
                     lambda form, start, stop, dtype: form.slab_t(start, stop, dtype)), reference=True)
table.register(Entry(NORM, "any", frozenset(), "torch's F.rms_norm", _norm_reference), reference=True)


_NORMS: dict = {}  # (device, x dtype, weight dtype) -> the NORM entry's run, chosen at the first call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x (..., n) / weight (n,) -> x / sqrt(mean(x^2) + eps) * weight, as F.rms_norm,
    through the NORM entry chosen once per device and dtypes (on the CPU for f32: one compiled pass a row, its sum of
    squares in LANES partial sums: a fixed order, a row's bits do not depend on the rows beside it)."""
    key = (x.device.type, x.dtype, weight.dtype)
    run = _NORMS.get(key)
    if run is None:
        name, weight_name = (str(t).removeprefix("torch.") for t in key[1:])
        run = _NORMS[key] = table.choose(NORM, key[0], name if name == weight_name else f"{name}*{weight_name}").run
    return run(x, weight, eps)


# Each form kind, the device its form lives on, and what it is.
_KINDS = (("int4", "cpu", "Q4_0 / Q4_1 / Q4_K on CPU without AVX2"),
          ("int8", "cpu", "Q8_0 as int8 codes (load(tensor, 'int8'); no file's default)"),
          ("ggml_tiles", "cpu", "Q4_0-Q8_0 / Q4_K-Q6_K on CPU with AVX2 (or AVX-512), 8 rows' blocks regrouped"),
          ("ggml", "cpu", "the other ggml types on CPU, in the file's blocks"),
          ("int4_cuda", "cuda", "Q4_* on CUDA"), ("int8_cuda", "cuda", "Q8_0 on CUDA"))


def kernel_lines() -> list[str]:
    """What runs each weight form's products and slabs on this machine (kvcli info): for each kind, the PRODUCT and ROWS
    entry chosen and why, then the others and why not (kernel_table.why_not); the RMSNorm's the same."""
    lines = []

    def role(title: str, role: str, device: str, key, **shape):
        chosen = table.choose(role, device, key, **shape)
        lines.append(f"{title}: {chosen.name}" + (f"; {chosen.why}" if chosen.why else ""))
        for e in table.entries(role)[:-1]:  # the reference last: chosen where nothing else runs
            if key in e.keys and e is not chosen:
                shapes = ", ".join(f"{k} {str(v).removeprefix('torch.')}" for k, v in shape.items())
                why = table.why_not(e, device) or (f"not for {shapes}" if not e.covers(**shape)
                                                   else "an entry above it runs")
                lines.append(f"  not {e.name}: {why}")

    for kind, device, what in _KINDS:
        here = "" if device == "cpu" or torch.cuda.is_available() else ", no CUDA device here"
        if kind == "ggml":  # chosen per type: the byte-product kernel covers some
            for t in ("Q4_K", "IQ4_XS"):
                role(f"{kind} product ({t})", PRODUCT, device, kind, ggml_type=t)
        else:
            role(f"{kind} product ({what}{here})", PRODUCT, device, kind)
        if any(kind in e.keys for e in table.entries(ROWS)):
            for dtype in (torch.bfloat16, torch.float32):
                role(f"{kind} {str(dtype).removeprefix('torch.')} slabs", ROWS, device, kind, dtype=dtype)
        else:
            role(f"{kind} slabs", ROWS, device, kind)
    lines.append("dense product: F.linear on the plain tensor (no kernel)")
    role("rms_norm f32 (cpu)", NORM, "cpu", "float32")
    import kvcli.rope  # noqa: F401  (registers RoPE's entries)

    role("rope f32 (cpu)", ROPE, "cpu", "float32")
    import kvcli.swiglu  # noqa: F401

    role("swiglu f32 (cpu)", SWIGLU, "cpu", "float32")
    return lines
