"""Keys stored less their turning mean (issue 41): the cache-level key treatment of kvcli's rotated types.

A key is k = R(p) (W x + b): RoPE of the projection plus the model's K bias (qwen2's attn_k.bias; none in llama).
Before RoPE, a head's keys share a large mean m = b + E[W x] (in the first layers of Qwen2.5 files b alone reaches
|b| 145 against a median of 6.4; llama's projections have a mean of 7-15 in a few channels). After RoPE that mean
turns with the position, so neither a block's scale nor a constant offset takes it out: a block's one scale spends
its levels on it, and the error grows with the position as it turns away from the angles of the first batch
(benchmarks/README.md, "Keys less their mean"). The cache stores k - R(p) m instead and attention adds back the
exact q . R(p) m to each score of a stored position (the window's f16 keys keep theirs: it costs f16 nothing).

m is each sequence's own: the mean, before RoPE, of its first batch's keys past the sinks (the model's K bias where
that batch has none), set when the sequence starts (position 0) and kept for its life, as the rotated stores set
their offset (kvcli/cache/hadamard.py). With the rotation as complex pairs (rot[p] = s e^{i p theta}, kvcli/rope.py:
pair j is (2j, 2j+1), or (j, j + D/2) for NEOX), q . R(p) m = Re(sum_j conj(q_j) m_j rot[p]_j) = sum_j u_j cos_j(p)
+ w_j sin_j(p) with u_j = q1 m1 + q2 m2 and w_j = q2 m1 - q1 m2: one product of (u, w) with the RoPE table's rows.
Bytes: m, (L, B, Hkv, D) f32, counted in the cache's size as the offsets are.
"""

from __future__ import annotations

import copy

import torch

from kvcli.rope import rope_

KEY_BIAS = ("auto", "on", "off")
N_SINK = 4  # first positions left out of the mean (attention sinks: their keys are not like the rest)


def treats(policy: str, k_type) -> bool:
    """Does a cache with --key-bias `policy` store keys of this storage type (a Store class) less their mean?
    auto: kvcli's rotated types (q4_hadamard, tq4/tq3/tq2), where it was measured to pay; llama.cpp's types keep
    llama.cpp's bytes unless asked (on: every type, the dense ones too, where it changes nothing but rounding)."""
    return policy == "on" or (policy == "auto" and k_type.rotated and not k_type.dense)


class KeyBias:
    """bias (L, Hkv, D) f32: each layer's K bias (before RoPE; zeros for a model without one); rot (n_ctx, D/2)
    complex64: the model's RoPE table; neox: its pair layout. `start` sets a sequence's mean from its first batch,
    `remove` takes R(p) m off keys before they are stored, `scores` gives what to add back. for_rows(B) makes the
    per-sequence means of a B-sequence cache; rows(a, z) a view of sequences a..z-1 (the server's slots)."""

    def __init__(self, bias: torch.Tensor, rot: torch.Tensor, neox: bool, batch: int = 1):
        self.bias, self.rot, self.neox = bias.float().contiguous(), rot, neox
        self.inverse = rot.conj() / rot.abs().square()  # R(p)^-1 (YaRN's mscale on cos and sin)
        # the table's rows as (cos_0, sin_0, cos_1, sin_1, ..): (n_ctx, D), a view of rot
        self.table = torch.view_as_real(rot).flatten(-2)
        self._columns: list = [None]  # columns(), made on first use: a list that the rows views share
        self._means(self.bias[:, None].repeat(1, batch, 1, 1))

    def _means(self, mean: torch.Tensor) -> None:
        """mean (L, B, Hkv, D) f32, and its pairs (m1, m2) as rope_ pairs the elements: views, (L, B, Hkv, D/2)."""
        D = mean.shape[-1]
        self.mean = mean
        self._operands = None  # operands(), per layer
        self.m1, self.m2 = (mean[..., : D // 2], mean[..., D // 2 :]) if self.neox else (mean[..., 0::2], mean[..., 1::2])

    @classmethod
    def from_model(cls, model, layers: list[int], k_scale: torch.Tensor | None = None) -> "KeyBias":
        """The K bias of `layers` of a Transformer (kvcli/model.py) whose blocks carry one (bqkv), else zeros; times
        k_scale (len(layers), Hkv, D) where the cache keeps keys scaled (kvcli/cache/key_scale.py)."""
        c = model.c
        k0, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        bias = torch.stack([torch.zeros(kv) if model.blocks[i].bqkv is None else model.blocks[i].bqkv[k0 : k0 + kv]
                            for i in layers]).view(len(layers), c.n_kv_heads, c.head_dim)
        return cls(bias if k_scale is None else bias.float() * k_scale.to(bias.device), model.rot, c.rope_neox)

    def for_rows(self, batch: int) -> "KeyBias":
        """This treatment with means of its own for a cache of `batch` sequences."""
        return KeyBias(self.bias, self.rot, self.neox, batch)

    def rows(self, start: int, stop: int) -> "KeyBias":
        """Sequences start..stop-1, their means shared with this one's."""
        view = copy.copy(self)
        view._means(self.mean[:, start:stop])
        return view

    def columns(self) -> torch.Tensor:
        """The table in blocks of 16 positions, (n_ctx / 16 + 1, D, 16) f32, zeros past n_ctx: block i's columns are
        positions 16 i .. 16 i + 15, as the CPU decode kernel reads them (kvcli/kernels/cpu/attention_rotated.py);
        made once, shared by the rows views."""
        if self._columns[0] is None:
            n, D = self.table.shape
            cols = torch.zeros(n // 16 + 1, 16, D)
            cols.view(-1, D)[:n] = self.table
            self._columns[0] = cols.transpose(1, 2).contiguous()
        return self._columns[0]

    def operands(self, layer: int) -> tuple:
        """What the CPU decode kernel reads (kvcli/kernels/cpu/attention_rotated.py): this layer's means m (B, Hkv, D)
        f32, the pair layout, the table's columns; numpy views, made once per layer (and rows view)."""
        if self._operands is None:
            self._operands = [(m.numpy(), self.neox, self.columns().numpy()) for m in self.mean.unbind(0)]
        return self._operands[layer]

    def nbytes(self) -> int:
        return self.mean.numel() * self.mean.element_size()

    def start(self, layer: int, k: torch.Tensor) -> None:
        """k (B, T, H, D) f32: the keys of positions 0..T-1 of new sequences -> their mean before RoPE, past the
        sinks (the bias where there are none)."""
        T = k.shape[1]
        if T <= N_SINK:
            self.mean[layer] = self.bias[layer]
            return
        x = k[:, N_SINK:].float().clone(memory_format=torch.contiguous_format)
        rope_(x, self.inverse[N_SINK:T], self.neox)  # back before RoPE
        self.mean[layer] = x.mean(1)

    def rotated(self, layer: int, pos: int | torch.Tensor, T: int) -> torch.Tensor:
        """R(p) m at positions pos..pos+T-1: (B, T, H, D); pos a (B,) tensor (T = 1): each row its own."""
        m = self.mean[layer]  # (B, H, D)
        x = m[:, None].expand(-1, T, -1, -1).clone()
        rope_(x, self.rot[pos.to(self.rot.device)].unsqueeze(1) if torch.is_tensor(pos) else self.rot[pos : pos + T],
              self.neox)
        return x

    def remove(self, layer: int, k: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        """k (B, T, H, D) f32 at positions pos..pos+T-1 (or a (B,) pos at T = 1) -> k - R(p) m, a new tensor."""
        return k - self.rotated(layer, pos, k.shape[1])

    def scores(self, layer: int, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """q (B, H, R, D) f32 in the model's space (scaled as the scores are) -> q . R(p) m for p in start..end-1:
        (B, H, R, end - start) f32."""
        return self.query(layer, q) @ self.table[start:end].T

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """R(p) m for p in start..end-1 as the stores lay keys out: (B, H, end - start, D) f32."""
        return self.rotated(layer, start, end - start).transpose(1, 2)

    def query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, R, D) f32 -> (u_0, w_0, u_1, w_1, ..) (B, H, R, D): what multiplies a table row to give q . R(p) m."""
        D = q.shape[-1]
        pairs = q.view(*q.shape[:-1], 2, D // 2) if self.neox else q.view(*q.shape[:-1], D // 2, 2).transpose(-1, -2)
        q1, q2 = pairs.unbind(-2)  # (B, H, R, D/2)
        m1, m2 = self.m1[layer][:, :, None], self.m2[layer][:, :, None]  # (B, H, 1, D/2)
        return torch.stack([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], -1).flatten(-2)  # (B, H, R, D): u_j, w_j in turn
