"""The CPU's RMSNorm pass (numba; kvcli/weights.py's NORM entry for f32, behind rms_norm), in a module of its own so
that it is imported only where it runs.

torch's CPU rms_norm costs ~15 us a call at decode's few rows (several ops: pow, mean, rsqrt, two products),
and a decode step runs two a layer; this is one pass a row, its sum of squares in LANES partial sums (a fixed
order: a row's bits do not depend on the rows beside it). Figures: benchmarks/README.md.

At module level, not built in a closure: numba's on-disk cache never matches a closure's kernel, so a closure
compiled anew in every process (~1.5 s at start) and left one more cache file behind each time.
"""

from __future__ import annotations

import numpy as np

from .compile import LANES, dot, jit


@jit
def norm(x_any, w, eps):
    """x_any (..., n) f32, w (n,) f32 -> x / sqrt(mean(x^2) + eps) * w; a row's sum of squares in LANES partial sums
    (a fixed order: a row's bits do not depend on the rows beside it)."""
    x = x_any.reshape(-1, x_any.shape[-1])
    out = np.empty_like(x)
    n = x.shape[1]
    whole = n - n % LANES
    lanes = np.empty(LANES, np.float32)
    for r in range(x.shape[0]):
        row = x[r]
        s = dot(row, row, whole, lanes)
        for e in range(whole, n):
            s += row[e] * row[e]
        inv = np.float32(1) / np.sqrt(s / np.float32(n) + eps)
        for e in range(n):
            out[r, e] = row[e] * inv * w[e]
    return out.reshape(x_any.shape)
