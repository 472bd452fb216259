"""What a store's kernels need to know of its bytes (ggml's type traits, as a record), and the records the
kernels take: a store layer's operands, and a decode step's window.

Each cache Store returns a KernelLayout from `kernel_layout()` (None: no kernel reads it); the kernels in
kvcli.kernels take tensors or arrays plus these records and import nothing from kvcli. KIND says how a vector
is decoded; the offsets say where a 32-element block keeps its fields.

Every CPU decode attention kernel (kvcli/kernels/cpu/attention*.py) has one signature:
    attend(q, k: Operands, v: Operands, lim, window: DecodeWindow | None, extra=None) -> out
q (B, Hkv, G, D) f32, the query heads of each KV head in the model's space (unscaled: the kernel scales the
scores by 1 / sqrt(D)); lim (B,) int64 numpy: row b reads store positions 0..lim[b]-1; extra: None, or (B, Hkv, G,
P >= max lim) f32 numpy added to the (scaled) score of each store position t < lim[b] (keys stored less their bias:
kvcli/cache/key_bias.py); out (B, Hkv, G, D) f32 torch, in the model's space: attend_reference's result
(kvcli/attention.py) for one query token per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple



class Kind:
    """The kernels' KIND codes: one constexpr branch for each way of decoding a vector."""

    F32, F16, BF16 = 0, 1, 2
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL = 3, 4, 5, 6, 7, 8
    HADAMARD_KEYS, HADAMARD_VALUES = 9, 10  # q4_hadamard's codes: position tiles (K) or element tiles (V)
    TQ_KEYS, TQ_VALUES = 11, 12  # tq4/tq3/tq2's b-bit codes: packed key tiles or value planes (kvcli/cache/turbo.py)


DENSE_KINDS = (Kind.F32, Kind.F16, Kind.BF16)
GGML_KINDS = (Kind.Q8_0, Kind.Q4_0, Kind.Q4_1, Kind.Q5_0, Kind.Q5_1, Kind.IQ4_NL)


@dataclass(frozen=True)
class KernelLayout:
    kind: int  # a Kind code
    block_bytes: int = 0  # bytes per 32-element block, scales included; 0: dense, one value per element
    d_offset: int = 0  # byte offset of the block's fp16 scale d
    m_offset: int = 0  # byte offset of its fp16 minimum m (q4_1, q5_1)
    qh_offset: int = 0  # byte offset of its 4 bytes of fifth bits (q5_0, q5_1)
    qs_offset: int = 0  # byte offset of its nibbles (q8_0: its 32 int8 values)
    table: tuple[float, ...] = ()  # iq4_nl, tq: the codebook; q4_hadamard: the scale grid its quantizer tries
    n_sink: int = 0  # rotated types: leading positions read from the f16 sink tensor instead of the codes
    tile: int = 0  # rotated types: T, positions (keys) or elements (values, min(T, D)) per int4 tile
    bits: int = 4  # tq: bits per code (4, 3 or 2), packed as kvcli/cache/turbo.py's pack_rows
    scale_block: int = 32  # rotated types: elements per bf16 scale
    steps: tuple[float, ...] = ()  # tq: the quantizer's candidate scales over max|y| (or the signed largest)
    signed: bool = False  # tq: candidates over the block's signed largest element, not max|y|


class Operands(NamedTuple):
    """One layer of a cache store as a kernel reads it (kvcli.cache.base.Store.operands, made once per layer and
    rows view): its layout record, its tensors (B, Hkv, ...) in the store's kernel_operands order (dense and ggml
    block types: data (B, Hkv, n_ctx, D or row_bytes); rotated types: codes, scales (bf16), sinks (f16), offsets
    (B, Hkv, D) f32), the same as numpy views for the CPU kernels (bf16 as int16 bits, f16 as uint16 bits, other
    dtypes as they are), and a rotated type's rotation R (D, D) f32 (r = x @ R.T; None elsewhere) with its first row
    as a numpy array (s / sqrt(D): R = H diag(s) / sqrt(D), the Walsh-Hadamard form the CPU kernels apply)."""

    layout: KernelLayout
    tensors: tuple
    arrays: tuple
    rotation: object = None
    signs: object = None


class DecodeWindow(NamedTuple):
    """A decode step's f16 recent window as the CPU kernels read it: kv (B, 2 Hkv, N, D) uint16 (f16 bits), K's
    heads then V's, in the model's space; masked (B, N) bool, True where row b reads no slot n. Row b reads its
    store below lim[b] and its unmasked slots here (kvcli/cache/window.py)."""

    kv: object
    masked: object
