"""Dense storage: f32, f16, bf16, one plain tensor (L, B, Hkv, n_ctx, D) per store."""

from __future__ import annotations

import numpy as np
import torch

from kvcli.kernels.layout import Kind, KernelLayout
from kvcli.memory import lazy_zeros
from kvcli.cache.base import Store


class DenseStore(Store):
    dense = True  # no recent window: its f16 copy would hold what the store holds
    batched = ("data",)
    per_row_positions = True
    dtype: torch.dtype
    kind: int  # the kernels' KIND (kvcli/kernels/layout.py)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.data = lazy_zeros((self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim),
                               self.dtype, self.device)
        self._layout = KernelLayout(self.kind)
        self._rows = np.arange(self.batch, dtype=np.int64)  # a decode write's sequences 0..B-1 (a rows view's too)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def kernel_layout(self) -> KernelLayout:
        return self._layout


    def store(self, layer: int, x: torch.Tensor, pos: int | torch.Tensor) -> None:
        """pos: an int, or at decode (T = 1) a (B,) tensor, each sequence's own position."""
        if torch.is_tensor(pos):
            self.data[layer, self.sequences(x.shape[0]), :, pos] = x[:, 0].to(self.dtype)  # (B, Hkv, D)
            return
        self.data[layer, :, :, pos : pos + x.shape[1]] = x.transpose(1, 2)

    def store_pair(self, other: "DenseStore", layer: int, x: torch.Tensor, y: torch.Tensor,
                   pos: int | torch.Tensor) -> None:
        """One new token per sequence: K and V through the bound writer in one call where there is one (a compiled
        pass on the CPU)."""
        if self.writer is None or x.shape[1] != 1:
            return super().store_pair(other, layer, x, y, pos)
        B = x.shape[0]
        at = pos.numpy() if torch.is_tensor(pos) else np.full(B, pos, np.int64)
        self.writer(self._layout, (self.operands(layer).arrays[0], other.operands(layer).arrays[0]),
                    (x[:, 0], y[:, 0]), self._rows[:B], at)

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.data[layer, :, :, start:end].float()  # a view (no copy) for f32


class F32Store(DenseStore):
    name, block_bytes, dtype, kind = "f32", 4, torch.float32, Kind.F32


class F16Store(DenseStore):
    name, block_bytes, dtype, kind = "f16", 2, torch.float16, Kind.F16


class BF16Store(DenseStore):
    name, block_bytes, dtype, kind = "bf16", 2, torch.bfloat16, Kind.BF16
