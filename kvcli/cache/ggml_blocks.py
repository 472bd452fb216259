"""ggml block storage: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, packed as llama.cpp packs them.

Each store holds one uint8 tensor (L, B, Hkv, n_ctx, D // 32 * block_bytes): every head vector
is a row of ggml blocks (ggml-common.h `block_q4_0` etc.), so the cache's bytes are its real
size. Quantizers are ggml's reference ones (ggml-quants.c `quantize_row_*_ref`, as ported by
gguf-py's `gguf/quants.py`); the bytes equal `gguf.quants.quantize` for the same values.
All fp16 fields are little-endian, as are the tensors' bytes on the hosts torch runs on.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from kvcli.memory import lazy_zeros
from kvcli.cache.base import STORAGE_TYPES, Store
from kvcli.kernels.layout import Kind, KernelLayout

# The one table of sizes: name -> (elements per block, bytes per block, scales included).
# Bits per element = 8 * bytes / elements: q8_0 8.5, q4_0 4.5, q4_1 5, q5_0 5.5, q5_1 6, iq4_nl 4.5.
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 34),    # fp16 d, 32 x int8
    "q4_0": (32, 18),    # fp16 d, 16 bytes of nibbles
    "q4_1": (32, 20),    # fp16 d, fp16 m, 16 bytes of nibbles
    "q5_0": (32, 22),    # fp16 d, 4 bytes qh, 16 bytes of nibbles
    "q5_1": (32, 24),    # fp16 d, fp16 m, 4 bytes qh, 16 bytes of nibbles
    "iq4_nl": (32, 18),  # fp16 d, 16 bytes of nibbles indexing KVALUES_IQ4NL
}

# ggml-common.h `kvalues_iq4nl`: the non-linear 4-bit codebook.
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: iq4_nl blocks with max |x| below this get d = 0
_BIT_VALUES = 2.0 ** torch.arange(8)  # (8,) f32: bit k of a qh byte is element 8 * byte + k
# (256, 8): a qh byte -> its 8 bits as 0 or 16, the value of bit 4 in each element
_HIGH_BITS = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) << 4).to(torch.uint8)


# ---- shared pieces; blocks are (..., 32) f32 in, (..., bytes) uint8 out ----

def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(..., 1) f32 -> (..., 2) uint8: fp16 with round-to-nearest-even, like GGML_FP32_TO_FP16."""
    return v.half().view(torch.uint8)


def _f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each (..., bytes) block -> (..., 1) f32."""
    return blocks[..., offset : offset + 2].view(torch.float16).float()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 32) uint8 in 0..15 -> (..., 16): byte j = element j | element j+16 << 4 (ggml order)."""
    return q[..., :16] | (q[..., 16:] << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 -> (..., 32) uint8: low nibbles are elements 0..15, high ones 16..31."""
    qs = qs.contiguous()  # uint8 ops on the strided slice cost more than this copy plus ops
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _nibbles_f32(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 -> (..., 32) f32 nibble values, written straight into one buffer: the
    decode hot path (no uint8 concatenation; callers scale in place)."""
    qs = qs.contiguous()
    out = torch.empty(*qs.shape[:-1], 32, dtype=torch.float32, device=qs.device)
    out[..., :16] = qs & 0x0F
    out[..., 16:] = qs >> 4
    return out


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """(..., 32) uint8 in 0..31 -> (..., 4) qh: bit j of the little-endian uint32 is bit 4 of element j."""
    bits = (q >> 4).reshape(*q.shape[:-1], 4, 8).float()
    return (bits @ _BIT_VALUES.to(q.device)).to(torch.uint8)  # distinct bits: the sum is their OR, exact in f32


def _unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) qh -> (..., 32) uint8 holding each element's bit 4 (as 0 or 16)."""
    bits = F.embedding(qh.long(), _HIGH_BITS.to(qh.device))  # a table lookup: broadcast uint8 shifts are slow
    return bits.reshape(*qh.shape[:-1], 32)


def _div(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c rounded as C's division on every device: CUDA torch multiplies by the reciprocal of a Python-scalar
    divisor, one ulp off for c = 15, 31 or 127 (a device scalar takes the IEEE division)."""
    return a / torch.tensor(float(c), dtype=a.dtype, device=a.device) if a.is_cuda else a / c


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """ggml's `id = d ? 1.0f/d : 0.0f`."""
    return torch.where(d == 0, 0.0, 1.0 / d)


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """(..., 32) -> (..., 1): the value of largest magnitude with its sign, first one on ties."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))


def _symmetric_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 / q5_0 (quantize_row_q{4,5}_0_ref), levels 16 / 32: d = signed absmax / -(levels / 2),
    q = min(levels - 1, (int8)(x / d + levels / 2 + 0.5)). -> d (..., 1) f32, q (..., 32) uint8."""
    d = _div(_signed_absmax(x), -(levels // 2))
    return d, (x * _inverse(d) + (levels // 2 + 0.5)).clamp_(0, levels - 1).to(torch.uint8)


def _min_max_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1 / q5_1 (quantize_row_q{4,5}_1_ref), levels 16 / 32: d = (max - min) / (levels - 1),
    q = (x - min) / d + 0.5, clipped as gguf-py. -> d, min (..., 1) f32, q (..., 32) uint8."""
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = _div(hi - lo, levels - 1)
    return d, lo, ((x - lo) * _inverse(d) + 0.5).clamp_(0, levels - 1).to(torch.uint8)


def _round_to_int8(v: torch.Tensor) -> torch.Tensor:
    """(int8_t)roundf(v) for |v| < 127.5, halves away from zero: trunc(v) plus trunc of twice the fraction."""
    t = v.to(torch.int8)  # casts truncate, like C (and beat torch.trunc on CPU)
    return t + (2 * (v - t)).to(torch.int8)  # v - t and the doubling are exact in f32


class GgmlBlockStore(Store):
    """A ggml block format; subclasses give quantize_blocks and dequantize_blocks."""

    batched = ("data",)
    per_row_positions = True
    # the block's fields for the kernels (ggml-common.h): KIND, fp16 m, 4 bytes of fifth bits, nibbles
    kind: ClassVar[int | None] = None  # None: no kernel reads this type (a new type may start so)
    m_offset: ClassVar[int] = 0
    qh_offset: ClassVar[int] = 0
    qs_offset: ClassVar[int] = 2
    table: ClassVar[tuple[float, ...]] = ()

    def kernel_layout(self) -> KernelLayout | None:
        if self.kind is None:
            return None
        return KernelLayout(self.kind, self.block_bytes, d_offset=0, m_offset=self.m_offset,
                                   qh_offset=self.qh_offset, qs_offset=self.qs_offset, table=self.table)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_bytes = self.head_dim // self.block_size * self.block_bytes
        self.data = lazy_zeros((self.n_layers, self.batch, self.n_heads, self.n_ctx, self.row_bytes),
                               torch.uint8, self.device)

    def nbytes(self) -> int:
        return self.data.numel()

    def store(self, layer: int, x: torch.Tensor, pos: int | torch.Tensor) -> None:
        """pos: an int, or at decode (T = 1) a (B,) tensor, each sequence's own position."""
        self.write(layer, x.float(), pos)

    def store_pair(self, other: "GgmlBlockStore", layer: int, x: torch.Tensor, y: torch.Tensor,
                   pos: int | torch.Tensor) -> None:
        """K here, V in `other` (same type), quantized in one pass: the quantizer's few dozen small ops
        run once per token instead of twice."""
        B = x.shape[0]
        blocks = self.quantize(torch.cat([x.float(), y.float()]))  # (2B, Hkv, T, row_bytes)
        self._put(layer, blocks[:B], pos)
        other._put(layer, blocks[B:], pos)

    def _put(self, layer: int, blocks: torch.Tensor, pos: int | torch.Tensor) -> None:
        """blocks (B, Hkv, T, row_bytes) into positions pos..pos+T-1 (a (B,) pos: T = 1, each row at its own)."""
        if torch.is_tensor(pos):
            self.data[layer, self.sequences(blocks.shape[0]), :, pos] = blocks[:, :, 0]
        else:
            self.data[layer, :, :, pos : pos + blocks.shape[2]] = blocks

    def quantize_reference(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, Hkv, D) f32 -> blocks (B, Hkv, T, row_bytes): quantized before the transpose, on fewer bytes."""
        B, T, H, D = x.shape
        blocks = self.quantize_blocks(x.reshape(B, T, H, D // self.block_size, self.block_size))
        return blocks.reshape(B, T, H, self.row_bytes).transpose(1, 2)

    def write(self, layer: int, x: torch.Tensor, pos: int | torch.Tensor) -> None:
        """Quantize x (B, T, Hkv, D) f32 into positions pos..pos+T-1 (pos: as `store`)."""
        self._put(layer, self.quantize(x), pos)

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        rows = self.data[layer, :, :, start:end]  # (B, H, t, row_bytes), a view
        blocks = rows.view(*rows.shape[:-1], self.head_dim // self.block_size, self.block_bytes)
        return self.dequantize_blocks(blocks).reshape(*rows.shape[:-1], self.head_dim)

    @staticmethod
    def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Q8_0Store(GgmlBlockStore):
    name = "q8_0"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind = Kind.Q8_0

    @staticmethod
    def quantize_blocks(x):
        d = _div(x.abs().amax(dim=-1, keepdim=True), 127)  # quantize_row_q8_0_ref: qs = roundf(x / d)
        q = _round_to_int8(x * _inverse(d)).view(torch.uint8)
        return torch.cat([_f16_bytes(d), q], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        return blocks[..., 2:].contiguous().view(torch.int8).float().mul_(_f16_at(blocks, 0))


class Q4_0Store(GgmlBlockStore):
    name = "q4_0"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind = Kind.Q4_0

    @staticmethod
    def quantize_blocks(x):
        d, q = _symmetric_codes(x, 16)
        return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        return _nibbles_f32(blocks[..., 2:]).sub_(8).mul_(_f16_at(blocks, 0))


class Q4_1Store(GgmlBlockStore):
    name = "q4_1"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind, m_offset, qs_offset = Kind.Q4_1, 2, 4

    @staticmethod
    def quantize_blocks(x):
        d, lo, q = _min_max_codes(x, 16)
        return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        return _nibbles_f32(blocks[..., 4:]).mul_(_f16_at(blocks, 0)).add_(_f16_at(blocks, 2))


class Q5_0Store(GgmlBlockStore):
    name = "q5_0"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind, qh_offset, qs_offset = Kind.Q5_0, 2, 6

    @staticmethod
    def quantize_blocks(x):
        d, q = _symmetric_codes(x, 32)
        return torch.cat([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q & 0x0F)], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        q = _unpack_nibbles(blocks[..., 6:]) | _unpack_high_bits(blocks[..., 2:6])
        return _f16_at(blocks, 0) * (q.float() - 16)


class Q5_1Store(GgmlBlockStore):
    name = "q5_1"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind, m_offset, qh_offset, qs_offset = Kind.Q5_1, 2, 4, 8

    @staticmethod
    def quantize_blocks(x):
        d, lo, q = _min_max_codes(x, 32)
        return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q & 0x0F)], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        q = _unpack_nibbles(blocks[..., 8:]) | _unpack_high_bits(blocks[..., 4:8])
        return _f16_at(blocks, 0) * q.float() + _f16_at(blocks, 2)


class IQ4_NLStore(GgmlBlockStore):
    """quantize_row_iq4_nl_ref (llama.cpp's CPU cache path): ntry = -1, weights x^2, no imatrix.

    Nearest codebook index for x / d0 with d0 = max / -127, then the weighted least-squares
    scale d = sum(w q x) / sum(w q^2); ntry = -1 leaves the +-ntry scale search empty and keeps
    the indices. ggml sums in element order in f32, so the sums run in that order here too.
    Blocks with max |x| < 1e-15 get d = 0; ggml leaves their nibbles stale, we write zeros.
    """

    name = "iq4_nl"
    block_size, block_bytes = GGML_BLOCKS[name]
    kind, table = Kind.IQ4_NL, tuple(float(v) for v in KVALUES_IQ4NL)

    @staticmethod
    def quantize_blocks(x):
        values = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=x.device)
        mx = _signed_absmax(x)
        live = mx.abs() >= GROUP_MAX_EPS  # (..., 1)
        al = (x * torch.where(live, 1.0 / _div(mx, -127), 0.0)).contiguous()  # x's strides otherwise: bucketize copies
        # best_index_int8: the bracketing pair by binary search, the nearer wins, ties go up
        hi = torch.bucketize(al, values, right=True).clamp_(1, 15)
        lo = hi - 1
        idx = torch.where(al - values.take(lo) < values.take(hi) - al, lo, hi)
        q = values.take(idx)  # take: faster than values[idx] on CPU
        wq = (x * x) * q  # weight w = x^2; C evaluates w*q*x as (w*q)*x
        terms = torch.stack([wq * x, wq * q], dim=0).movedim(-1, 0)  # (32, 2, ...)
        sums = torch.zeros_like(terms[0])  # ggml: sumqx = sumq2 = 0, then += term by term
        for term in terms.unbind(0):  # 32 vector adds in ggml's f32 order, all blocks at once
            sums = sums + term
        sumqx, sumq2 = sums[0][..., None], sums[1][..., None]
        d = torch.where(live & (sumq2 > 0), sumqx / sumq2, 0.0)
        idx = torch.where(live, idx, 0).to(torch.uint8)
        return torch.cat([_f16_bytes(d), _pack_nibbles(idx)], dim=-1)

    @staticmethod
    def dequantize_blocks(blocks):
        values = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=blocks.device)
        return _f16_at(blocks, 0) * values.take(_unpack_nibbles(blocks[..., 2:]).long())


def quantize_reference(kind: str, x: torch.Tensor, dst: torch.Tensor, pos: int) -> None:
    """The PyTorch reference of the Triton write kernel (kvcli.kernels.gpu.quantize.quantize_into), same
    arguments with the type's name for its layout: x (B, T, Hkv, D) f32 -> rows pos..pos+T-1 of dst
    (B, Hkv, n_ctx, row_bytes or D), through the stores' own quantizers."""
    B, T, H, D = x.shape
    x = x.float()
    store_cls = STORAGE_TYPES[kind]
    if not issubclass(store_cls, GgmlBlockStore):  # dense: a cast
        dst[:, :, pos : pos + T] = x.transpose(1, 2).to(dst.dtype)
        return
    blocks = store_cls.quantize_blocks(x.reshape(B, T, H, D // 32, 32))
    dst[:, :, pos : pos + T] = blocks.reshape(B, T, H, -1).transpose(1, 2)
