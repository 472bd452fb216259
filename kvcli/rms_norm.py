"""RMSNorm over the last dimension: one compiled call on the CPU (numba), F.rms_norm elsewhere.

torch's CPU rms_norm costs ~15 us a call at decode's few rows (several ops: pow, mean, rsqrt, two products),
and a decode step runs two a layer; this is one pass a row, its sum of squares in LANES partial sums (a fixed
order: a row's bits do not depend on the rows beside it). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

_kernel = None  # the compiled pass, loaded at the first CPU call (numba imports only where it runs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., n) f32 / weight (n,) f32 -> x / sqrt(mean(x^2) + eps) * weight, as F.rms_norm."""
    global _kernel
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if _kernel is None:
        from kvcli.cache import cpu_jit

        _kernel = _compile(cpu_jit) if cpu_jit.available() else False
    if not _kernel:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.from_numpy(_kernel(x.contiguous().numpy(), weight.numpy(), np.float32(eps)))


def _compile(cpu_jit):
    LANES, dot = cpu_jit.LANES, cpu_jit.dot

    @cpu_jit.jit
    def norm(x_any, w, eps):
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

    return norm
