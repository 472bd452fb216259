"""Dense storage: f32, f16, bf16, one plain tensor (L, B, Hkv, n_ctx, D) per store."""

from __future__ import annotations

import torch

from kvcli.kernels import use_triton
from kvcli.cache.base import Store


class DenseStore(Store):
    dtype: torch.dtype

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.data = torch.zeros(self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim,
                                dtype=self.dtype, device=self.device)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def store(self, layer: int, x: torch.Tensor, pos: int) -> None:
        if use_triton(x):  # Triton write kernel (kernels/quantize.py); triton is imported only here
            from kvcli.kernels.quantize import quantize_into

            quantize_into(self.name, x, self.data[layer], pos)
            return
        self.data[layer, :, :, pos : pos + x.shape[1]] = x.transpose(1, 2)

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.data[layer, :, :, start:end].float()  # a view (no copy) for f32


class F32Store(DenseStore):
    name, block_bytes, dtype = "f32", 4, torch.float32


class F16Store(DenseStore):
    name, block_bytes, dtype = "f16", 2, torch.float16


class BF16Store(DenseStore):
    name, block_bytes, dtype = "bf16", 2, torch.bfloat16
