"""Key recipes: a transform of the keys around any store type, for keys with outlier channels (issue 41).

`KeyRecipeStore` wraps a K store of any registered type (`inner`): `store` transforms the keys, then the
inner store quantizes them; `load` reads the inner store, then undoes the transform, so that attention sees
model-space keys. It has no kernel layout: attention takes the PyTorch reference (load + matmul), so this is
the measuring path (benchmarks/key_recipes.py), not a fast one. The recipe's steps, in write order:
  1. pre_rope: undo RoPE (k = R(p) k0: store k0, apply R(p) again on read; KVQuant's pre-RoPE keys);
  2. bias: subtract the known K bias b (qwen2's attn_k.bias), as R(p) b after RoPE or b before it; added
     back exactly on read (a kernel would add q . R(p) b to each score);
     offset: subtract a constant m (per layer, head, channel: a calibrated mean) in the space steps 1-2
     leave; added back on read (after RoPE a kernel needs no add-back: softmax ignores q . m);
  3. outliers: channels kept in f16 beside the codes (KVQuant's dense-and-sparse), zero in the codes;
  4. scale: divide channel j by s_j (SmoothQuant's smoothing; a kernel folds s into the query);
and `alt`: a store of another type that holds the keys of `alt_layers` instead (a mixed cache), untransformed.
Side data a format would keep per token (the f16 outlier channels) is counted in `nbytes`; per-layer
constants (b, s, channel indices) belong to the model or a calibration file and are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.cache.base import Store
from kvcli.rope import rope_


@dataclass
class KeyRecipe:
    """What to do to keys before they are quantized (see the module docstring). Tensors per layer:
    bias, offset, scale (L, Hkv, D); outliers (L, Hkv, n) long channel indices."""

    pre_rope: bool = False
    bias: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    outliers: torch.Tensor | None = None


class KeyRecipeStore(Store):
    """A K store of `inner`'s type with `recipe` around it; rot (n_ctx, D/2) complex, the model's RoPE table."""

    def __init__(self, inner: Store, recipe: KeyRecipe, rot: torch.Tensor, neox: bool,
                 alt: Store | None = None, alt_layers: tuple[int, ...] = ()):
        super().__init__(inner.n_layers, inner.batch, inner.n_heads, inner.n_ctx, inner.head_dim, inner.device,
                         keys=True)
        self.inner, self.recipe, self.rot, self.neox = inner, recipe, rot, neox
        self.alt, self.alt_layers = alt, set(alt_layers)
        self.name = f"{inner.name}+recipe"
        n = 0 if recipe.outliers is None else recipe.outliers.shape[-1]
        # the f16 outlier channels of every position: (L, B, Hkv, n_ctx, n)
        self.side = torch.zeros(self.n_layers, self.batch, self.n_heads, self.n_ctx, n, dtype=torch.float16)

    def _rope(self, x: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        """x (B, T, H, D) at positions start.. -> R(p) x (inverse: R(p)^-1 x), a copy."""
        rot = self.rot[start : start + x.shape[1]]
        if inverse:
            rot = rot.conj() / rot.abs() ** 2
        x = x.clone(memory_format=torch.contiguous_format)
        rope_(x, rot, self.neox)
        return x

    def _bias(self, layer: int, start: int, T: int) -> torch.Tensor:
        """The bias as stored keys hold it at positions start..start+T-1: (1, T, H, D) or (1, 1, H, D)."""
        b = self.recipe.bias[layer][None, None]  # (1, 1, H, D)
        return b if self.recipe.pre_rope else self._rope(b.expand(1, T, -1, -1), start)

    def forward(self, layer: int, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Model-space keys x (B, T, H, D) -> what the inner store holds, and the f16 side channels (B, T, H, n)."""
        r = self.recipe
        x = x.float()
        if r.pre_rope:
            x = self._rope(x, pos, inverse=True)
        if r.bias is not None:
            x = x - self._bias(layer, pos, x.shape[1])
        if r.offset is not None:
            x = x - r.offset[layer]
        side = None
        if r.outliers is not None:
            idx = r.outliers[layer][None, None].expand(*x.shape[:2], -1, -1)  # (B, T, H, n)
            side = x.gather(-1, idx)
            x = x.scatter(-1, idx, 0.0)
        if r.scale is not None:
            x = x / r.scale[layer]
        return x, side

    def store(self, layer: int, x: torch.Tensor, pos: int) -> None:
        if torch.is_tensor(pos):
            raise NotImplementedError("KeyRecipeStore measures prefill (int positions) only")
        if layer in self.alt_layers:
            return self.alt.store(layer, x, pos)
        y, side = self.forward(layer, x, pos)
        if side is not None:
            self.side[layer, :, :, pos : pos + x.shape[1]] = side.transpose(1, 2).half()
        self.inner.store(layer, y, pos)

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Model-space keys (B, H, end - start, D) f32."""
        if layer in self.alt_layers:
            return self.alt.from_storage(self.alt.load(layer, start, end))
        r = self.recipe
        y = self.inner.from_storage(self.inner.load(layer, start, end))  # (B, H, n, D)
        if r.scale is not None:
            y = y * r.scale[layer][:, None]
        if r.outliers is not None:
            idx = r.outliers[layer][None, :, None].expand(*y.shape[:3], -1)  # (B, H, n, k)
            y = y.scatter(-1, idx, self.side[layer, :, :, start:end].float())
        y = y.transpose(1, 2)  # (B, n, H, D)
        if r.offset is not None:
            y = y + r.offset[layer]
        if r.bias is not None:
            y = y + self._bias(layer, start, end - start)
        if r.pre_rope:
            y = self._rope(y, start)
        return y.transpose(1, 2)

    def nbytes(self) -> int:
        """Bytes a cache of this recipe keeps: the inner store's of the layers it holds, the alt store's of
        alt_layers, and the f16 outlier channels."""
        L = self.n_layers
        own = self.inner.nbytes() * (L - len(self.alt_layers)) // L
        alt = self.alt.nbytes() * len(self.alt_layers) // L if self.alt is not None else 0
        n = self.side.shape[-1]
        return own + alt + (L - len(self.alt_layers)) * self.batch * self.n_heads * self.n_ctx * n * 2
