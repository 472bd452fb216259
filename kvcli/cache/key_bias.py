"""Keys stored less their bias (issue 41): the cache-level key treatment for models with a K bias (qwen2's
attn_k.bias).

A qwen2 key is k = R(p) (W x + b): RoPE of the projection plus a fixed bias. In the first layers of Qwen2.5 files
a few channels of b dwarf the rest (largest |b| 145, median 6.4 in layer 0 of Qwen2.5-Coder-0.5B), so a block's one
scale spends its levels on them and every other channel loses its bits; after RoPE they turn with the position, so
no constant offset removes them. The cache stores k - R(p) b = R(p) W x instead, and attention adds back the exact
q . R(p) b to each score of a stored position (the window's f16 keys keep their bias: it costs f16 nothing).

With the rotation as complex pairs (rot[p] = m e^{i p theta}, kvcli/rope.py: pair j is (2j, 2j+1), or (j, j + D/2)
for NEOX), q . R(p) b = Re(sum_j conj(q_j) b_j rot[p]_j) = sum_j u_j cos_j(p) + w_j sin_j(p) with u_j = q1 b1 + q2 b2
and w_j = q2 b1 - q1 b2: one product of (u, w) with the RoPE table's rows, the same table the model rotates with.
Nothing is added to the cache's bytes: b is the model's, the table the model's.

Measured (benchmarks/README.md, "Keys less their bias"): on Qwen2.5-Coder-0.5B it takes q8_0 keys from KLD 0.016
to 0.0003 and tq4's from 0.09 to 0.01; on a model without K bias it is not made.
"""

from __future__ import annotations

import torch

from kvcli.rope import rope_

KEY_BIAS = ("auto", "on", "off")


def treats(policy: str, k_type) -> bool:
    """Does a cache with --key-bias `policy` store keys of this storage type (a Store class) less their bias?
    auto: kvcli's rotated types (q4_hadamard, tq4/tq3/tq2), where it was measured to pay; llama.cpp's types keep
    llama.cpp's bytes unless asked (on: every type, the dense ones too, where it changes nothing but rounding)."""
    return policy == "on" or (policy == "auto" and k_type.rotated and not k_type.dense)


class KeyBias:
    """bias (L, Hkv, D) f32: each layer's K bias (before RoPE); rot (n_ctx, D/2) complex64: the model's RoPE table;
    neox: its pair layout. `remove` takes it off keys before they are stored, `scores` gives what to add back."""

    def __init__(self, bias: torch.Tensor, rot: torch.Tensor, neox: bool):
        self.bias, self.rot, self.neox = bias.float().contiguous(), rot, neox
        L, H, D = bias.shape
        # the bias's pairs (b1, b2), (L, H, D/2) each, as rope_ pairs the elements
        pairs = bias.view(L, H, 2, D // 2) if neox else bias.view(L, H, D // 2, 2).transpose(-1, -2)
        self.b1, self.b2 = pairs[:, :, 0].contiguous(), pairs[:, :, 1].contiguous()
        # the table's rows as (cos_0, sin_0, cos_1, sin_1, ..): (n_ctx, D), a view of rot
        self.table = torch.view_as_real(rot).flatten(-2)

    @classmethod
    def from_model(cls, model, layers: list[int]) -> "KeyBias":
        """The K bias of `layers` of a Transformer (kvcli/model.py) whose blocks carry one (bqkv)."""
        c = model.c
        k0 = c.n_heads * c.head_dim
        bias = torch.stack([model.blocks[i].bqkv[k0 : k0 + c.n_kv_heads * c.head_dim].view(c.n_kv_heads, c.head_dim)
                            for i in layers])
        return cls(bias, model.rot, c.rope_neox)

    def rotated(self, layer: int, pos: int | torch.Tensor, T: int) -> torch.Tensor:
        """R(p) b at positions pos..pos+T-1: (1, T, H, D); pos a (B,) tensor (T = 1): (B, 1, H, D), each its own."""
        b = self.bias[layer]
        if torch.is_tensor(pos):
            rot = self.rot[pos.to(self.rot.device)].unsqueeze(1)  # (B, 1, D/2)
            x = b.expand(len(pos), 1, -1, -1).clone()
        else:
            rot = self.rot[pos : pos + T]
            x = b.expand(1, T, -1, -1).clone()
        rope_(x, rot, self.neox)
        return x

    def remove(self, layer: int, k: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        """k (B, T, H, D) f32 at positions pos..pos+T-1 (or a (B,) pos at T = 1) -> k - R(p) b, a new tensor."""
        return k - self.rotated(layer, pos, k.shape[1])

    def scores(self, layer: int, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """q (B, H, R, D) f32 in the model's space (scaled as the scores are) -> q . R(p) b for p in start..end-1:
        (B, H, R, end - start) f32."""
        return self.query(layer, q) @ self.table[start:end].T

    def query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, R, D) f32 -> (u_0, w_0, u_1, w_1, ..) (B, H, R, D): what multiplies a table row to give q . R(p) b."""
        D = q.shape[-1]
        pairs = q.view(*q.shape[:-1], 2, D // 2) if self.neox else q.view(*q.shape[:-1], D // 2, 2).transpose(-1, -2)
        q1, q2 = pairs.unbind(-2)  # (B, H, R, D/2)
        b1, b2 = self.b1[layer][:, None], self.b2[layer][:, None]  # (H, 1, D/2)
        return torch.stack([q1 * b1 + q2 * b2, q2 * b1 - q1 * b2], -1).flatten(-2)  # (B, H, R, D): u_j, w_j in turn
