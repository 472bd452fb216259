"""Int4 weight tiles dequantized to a bf16 slab of W.T in one compiled pass (numba), for the bf16 GEMM that a
prompt's batch runs where the CPU multiplies bf16 in hardware (kvcli/weights.py: Int4's ROWS entry for bf16).

Torch takes four passes over the slab (each nibble half widened, a multiply-add, a conversion), each through
memory; this is one, and its bits are the same: a code (4 bits) times a bf16 scale is exact in f32, so
q s + (z - 8 s) rounds once, to bf16, to nearest even, either way.
"""

from __future__ import annotations

import numpy as np
import torch

from .compile import available, jit
from .vectors import bf16_from_f32

__all__ = ["available", "slab_bf16_t"]


@jit
def _slab_bf16_t(tiles, scale, zero, out):
    """tiles (n / T, K, T / 2) uint8: byte (i, k, j) holds W[T i + j, k] (low nibble) and W[T i + j + T / 2, k]
    (high); scale, zero (K / 32, n) f32: each block's s and z - 8 s -> out (K, n) uint16: bf16 bits of W.T,
    W = q s + (z - 8 s) = (q - 8) s + z."""
    NT, K, T2 = tiles.shape
    T = 2 * T2
    for k in range(K):
        g = k // 32
        for i in range(NT):
            for j in range(T2):
                b = tiles[i, k, j]
                n0 = T * i + j
                out[k, n0] = bf16_from_f32(np.float32(b & 15) * scale[g, n0] + zero[g, n0])
                out[k, n0 + T2] = bf16_from_f32(np.float32(b >> 4) * scale[g, n0 + T2] + zero[g, n0 + T2])


def slab_bf16_t(packed: torch.Tensor, sz: torch.Tensor, start: int, stop: int, tile: int,
                out: torch.Tensor) -> torch.Tensor:
    """Rows start..stop-1 (whole tiles) of an Int4 form's packed (N_pad, K / 2) uint8 and sz (K / 32, N_pad, 2)
    bf16 -> W.T (K, stop - start) bf16, written into `out` (K * (stop - start) elements) and returned."""
    n, K = stop - start, 2 * packed.shape[1]
    tiles = packed[start:stop].view(n // tile, K, tile // 2)
    sz = sz[:, start:stop].float()  # (K / 32, n, 2): a 32nd of the slab
    scale = sz[..., 0].contiguous()
    zero = sz[..., 1] - 8 * scale  # exact in f32 but for scale and zero some 2^16 apart (as Int4's f32 slabs)
    w = out.view(K, n)
    _slab_bf16_t(tiles.numpy(), scale.numpy(), zero.numpy(), w.view(torch.int16).numpy().view(np.uint16))
    return w
