"""The kernels' side of kvcli's attention dispatcher (`kvcli.attention.attend` calls it on CUDA).

Importing this module imports triton; `kvcli.attention` imports it only for CUDA queries.
"""

from __future__ import annotations

import torch


def attend_cuda(q: torch.Tensor, cache, layer: int, pos: int) -> torch.Tensor | None:
    """q (B, T, H, D) f32 on CUDA -> (B, T, H * D), or None where no kernel covers the case."""
    if not q.is_cuda:
        return None
    return _attend(q, cache, layer, pos)


def _attend(q: torch.Tensor, cache, layer: int, pos: int, **launch) -> torch.Tensor | None:
    """The decision and the launch, on any device triton runs on (CPU under TRITON_INTERPRET=1).

    -fa off asks for materialized scores: that is the reference's path, on any device.
    """
    from kvcli.kernels.attention import attend_kernel, supported

    if not cache.flash_attn or not supported(cache, q):
        return None
    return attend_kernel(q, cache, layer, pos, **launch)
