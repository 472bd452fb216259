"""The Llama decoder: RMSNorm, RoPE (GGUF adjacent-pair layout), GQA attention, SwiGLU.

It knows nothing of cache formats: each block hands q, its new K/V and its normed input x
to `cache.attention`, which stores what its format keeps (K/V, or x for the hidden-state
cache) and returns the attention output over what the cache holds.
The residual stream, norms, RoPE and softmax run in f32; matrices are resident forms
(kvcli/weights.py: packed int4/int8 codes or dense tensors) whose `matmul` takes and returns f32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcli.cache.base import Cache
from kvcli.config import ModelConfig
from kvcli.weights import Dense, cat


def rope_table(c: ModelConfig, n_ctx: int, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """(n_ctx, head_dim/2) complex64 rotations e^{i * pos * theta_j}, theta_j = base^(-2j/D)."""
    theta = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    if freq_factors is not None:  # llama3-style rope_freqs.weight divides each frequency
        theta = theta / freq_factors.double()
    pos = torch.arange(n_ctx, dtype=torch.float64) / c.rope_scale_factor  # linear scaling
    angles = torch.outer(pos, theta).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) f32; rot (T, D/2) complex. GGUF llama layout: rotate pairs (2i, 2i+1).

    llama.cpp's converter permutes Q/K rows of a Hugging Face checkpoint so that the
    pairs rotated together are adjacent (Meta's layout); this is the one place that relies on it.
    """
    B, T, H, D = x.shape
    xc = torch.view_as_complex(x.reshape(B, T, H, D // 2, 2))
    return torch.view_as_real(xc * rot[:, None, :]).reshape(B, T, H, D)


def rope_(x: torch.Tensor, rot: torch.Tensor) -> None:
    """apply_rope in place on x (B, T, H, D) f32, a view whose last dimension is contiguous (decode's
    few ops per layer: one complex multiply into the fused q/k/v product)."""
    xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, T, H, D/2)
    xc.mul_(rot[:, None])


def _form(w, dtype: torch.dtype):
    """A resident form as given, or a plain tensor as Dense at the compute dtype."""
    return w if hasattr(w, "matmul") else Dense(w.to(dtype))


class Block(nn.Module):
    def __init__(self, c: ModelConfig, w: dict, i: int, dtype: torch.dtype):
        super().__init__()
        p = f"blk.{i}."
        self.c, self.layer = c, i
        # Buffers, not parameters: no autograd, and .to(device) moves them.
        self.register_buffer("attn_norm", w[p + "attn_norm.weight"].float(), persistent=False)
        self.register_buffer("ffn_norm", w[p + "ffn_norm.weight"].float(), persistent=False)
        # Fused projections: one product for q,k,v and one for gate,up (fewer ops per token);
        # forms live on their device already (kvcli.llama loads them there). The matrices are taken
        # out of w, so that each layer's parts are freed once joined (load peak: one layer's copy).
        self.wqkv = cat([_form(w.pop(p + n), dtype) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")])
        self.wo = _form(w.pop(p + "attn_output.weight"), dtype)
        self.w_gate_up = cat([_form(w.pop(p + n), dtype) for n in ("ffn_gate.weight", "ffn_up.weight")])
        self.w_down = _form(w.pop(p + "ffn_down.weight"), dtype)
        self.dtype = dtype
        self.q_dim = c.n_heads * c.head_dim
        self._wkv = self._wk = self._wv_heads = None  # views of wqkv, made on first use

    @property
    def wkv(self):
        """The k,v rows of wqkv as a form (a view; a packed form's scales copied on first use)."""
        if self._wkv is None:
            self._wkv = self.wqkv.narrow(self.q_dim, 2 * self.c.kv_dim)
        return self._wkv

    @property
    def wk(self):
        """The k rows of wqkv as a form (a view, made once)."""
        if self._wk is None:
            self._wk = self.wqkv.narrow(self.q_dim, self.c.kv_dim)
        return self._wk

    @property
    def wv_heads(self) -> list:
        """Each KV head's rows of Wv, a form apiece (views): the hidden-state cache projects weighted sums with them."""
        if self._wv_heads is None:
            c = self.c
            self._wv_heads = [self.wqkv.narrow(self.q_dim + c.kv_dim + h * c.head_dim, c.head_dim)
                              for h in range(c.n_kv_heads)]
        return self._wv_heads

    def forms(self) -> dict:
        return {"wqkv": self.wqkv, "wo": self.wo, "w_gate_up": self.w_gate_up, "w_down": self.w_down}

    def project_k(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """K = RoPE(x Wk) for normed inputs x (B, n, n_embd) f32 at rot's n positions -> (B, n, Hkv, D) f32,
        multiplied as forward multiplies: the hidden-state cache rebuilds K so."""
        c = self.c
        k = self.wk.matmul(x)  # (B, n, kv_dim)
        return apply_rope(k.unflatten(-1, (c.n_kv_heads, c.head_dim)), rot)

    def forward(self, h: torch.Tensor, cache: Cache, pos: int, rot: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = h.shape  # h: (B, T, n_embd) f32 residual stream
        x = F.rms_norm(h, (c.n_embd,), self.attn_norm, c.rms_eps)
        qkv = self.wqkv.matmul(x).view(B, T, c.n_heads + 2 * c.n_kv_heads, c.head_dim)  # (B, T, H + 2*Hkv, D)
        rope_(qkv[:, :, : c.n_heads + c.n_kv_heads], rot)  # q and k rotated where they lie: no copies
        q, k, v = qkv.split((c.n_heads, c.n_kv_heads, c.n_kv_heads), 2)  # (B, T, H, D), (B, T, Hkv, D) x 2
        o = cache.attention(self.layer, q, k, v, x, pos)  # (B, T, H * D) f32
        h = h + self.wo.matmul(o)
        x = F.rms_norm(h, (c.n_embd,), self.ffn_norm, c.rms_eps)
        gate, up = self.w_gate_up.matmul(x).chunk(2, dim=-1)
        return h + self.w_down.matmul(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, weights: dict, dtype: torch.dtype, n_ctx: int):
        """weights: GGUF name -> resident form (kvcli.weights) for matrices, or a plain tensor (a
        matrix becomes Dense at `dtype`); norms and rope_freqs are plain tensors, kept f32. The blocks'
        matrices are taken out of it (see Block)."""
        super().__init__()
        self.c, self.dtype = c, dtype
        self.tok_embd = _form(weights["token_embd.weight"], dtype)
        # Tied embeddings: without output.weight the head reuses token_embd (as llama.cpp does).
        out = weights.get("output.weight")
        self.output = self.tok_embd if out is None else _form(out, dtype)
        self.untied = out is not None
        self.register_buffer("output_norm", weights["output_norm.weight"].float(), persistent=False)
        self.blocks = nn.ModuleList(Block(c, weights, i, dtype) for i in range(c.n_layers))
        self.register_buffer("rot", rope_table(c, n_ctx, weights.get("rope_freqs.weight")), persistent=False)

    def forms(self) -> dict:
        """Every resident matrix by a name (the tied head once): what `weight_bytes` must count."""
        out = {"tok_embd": self.tok_embd} | ({"output": self.output} if self.untied else {})
        return out | {f"blk.{i}.{k}": f for i, b in enumerate(self.blocks) for k, f in b.forms().items()}

    def weight_bytes(self) -> int:
        """Resident bytes of the weights: every form plus the f32 norms."""
        norms = sum(b.nbytes for b in self.buffers() if b is not self.rot)
        return sum(f.nbytes for f in self.forms().values()) + norms

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: Cache, pos: int, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions pos..pos+T-1 -> logits (B, T or 1, vocab) f32."""
        T = tokens.shape[1]
        h = self.tok_embd.rows(tokens)  # (B, T, n_embd) f32
        rot = self.rot[pos : pos + T]
        for block in self.blocks:
            h = block(h, cache, pos, rot)
        if last_only:
            h = h[:, -1:]
        h = F.rms_norm(h, (self.c.n_embd,), self.output_norm, self.c.rms_eps)
        return self.output.matmul(h)


def dtype_from_name(name: str) -> torch.dtype:
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]

