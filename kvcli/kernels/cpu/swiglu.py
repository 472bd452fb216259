"""SwiGLU on the CPU (numba; kvcli/swiglu.py's entry for f32): silu(gate) * up from the fused gate/up product's rows.

One compiled pass where torch takes a chunk, silu and a product (three ops, ~20 us a decode row in a step's cold
caches; libm's expf where torch's is SLEEF's: the two differ in the last bit at times). The decode layer
(decode_layer.py) calls the same function, so a row's bits do not depend on which path ran it.
"""

from __future__ import annotations

import numpy as np

from .compile import jit


@jit
def swiglu(gu):
    """gu (M, 2F) f32, gate then up -> (M, F) f32: g / (1 + e^-g) u, as torch's silu writes it."""
    M, F = gu.shape[0], gu.shape[1] // 2
    out = np.empty((M, F), np.float32)
    for m in range(M):
        for j in range(F):
            g = gu[m, j]
            out[m, j] = g / (np.float32(1) + np.exp(-g)) * gu[m, F + j]
    return out
