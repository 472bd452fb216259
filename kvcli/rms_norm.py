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

        _kernel = False
        if cpu_jit.available():
            from kvcli.rms_norm_cpu import norm as _kernel
    if not _kernel:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.from_numpy(_kernel(x.contiguous().numpy(), weight.numpy(), np.float32(eps)))

