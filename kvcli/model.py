"""The Llama decoder: RMSNorm, RoPE (GGUF adjacent-pair layout), GQA attention, SwiGLU.

It knows nothing of cache formats: each block hands q, its new K/V and its normed input x
to `cache.attention`, which stores what its format keeps (K/V, or x for the hidden-state
cache) and returns the attention output over what the cache holds.
The residual stream, norms, RoPE and softmax run in f32; a decode step multiplies in the
weights' dtype (a half-precision GEMV reads half the bytes), a prefill batch on CPU upcasts
them to f32 (CPU half-precision GEMM is slow; see `linear`; figures in benchmarks/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcli.cache.base import Cache
from kvcli.config import ModelConfig


# Rows above which a half-precision weight is upcast for the matmul: a CPU multiplies one row by
# f16 weights fast (GEMV), but a prefill batch faster as f32 GEMM, upcast included.
UPCAST_ROWS = 32


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., in) -> (..., out) f32; x is f32, w (out, in) in the compute dtype."""
    if w.dtype == x.dtype or (x.numel() // x.shape[-1] > UPCAST_ROWS and not w.is_cuda):
        return F.linear(x, w.float() if w.dtype != x.dtype else w)
    return F.linear(x.to(w.dtype), w).float()


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


class Block(nn.Module):
    def __init__(self, c: ModelConfig, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype):
        super().__init__()
        p = f"blk.{i}."
        self.c, self.layer = c, i
        # Buffers, not parameters: no autograd, and .to(device) moves them.
        self.register_buffer("attn_norm", w[p + "attn_norm.weight"].float(), persistent=False)
        self.register_buffer("ffn_norm", w[p + "ffn_norm.weight"].float(), persistent=False)
        # Fused projections: one matmul for q,k,v and one for gate,up (fewer ops per token).
        wqkv = torch.cat([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        self.register_buffer("wqkv", wqkv.to(dtype), persistent=False)
        self.register_buffer("wo", w[p + "attn_output.weight"].to(dtype), persistent=False)
        w_gate_up = torch.cat([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        self.register_buffer("w_gate_up", w_gate_up.to(dtype), persistent=False)
        self.register_buffer("w_down", w[p + "ffn_down.weight"].to(dtype), persistent=False)
        self.dtype = dtype
        self.q_dim = c.n_heads * c.head_dim

    def project_kv(self, x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K = RoPE(x Wk), V = x Wv for normed inputs x (B, n, n_embd) f32 at rot's n positions -> each
        (B, n, Hkv, D) f32, multiplied as forward multiplies: the hidden-state cache rebuilds K/V so."""
        c = self.c
        kv = linear(x, self.wqkv[self.q_dim :])  # (B, n, 2 * kv_dim)
        B, n = kv.shape[:2]
        k = apply_rope(kv[..., : c.kv_dim].reshape(B, n, c.n_kv_heads, c.head_dim), rot)
        return k, kv[..., c.kv_dim :].reshape(B, n, c.n_kv_heads, c.head_dim)

    def forward(self, h: torch.Tensor, cache: Cache, pos: int, rot: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = h.shape  # h: (B, T, n_embd) f32 residual stream
        x = F.rms_norm(h, (c.n_embd,), self.attn_norm, c.rms_eps)
        qkv = linear(x, self.wqkv)  # (B, T, (H + 2*Hkv) * D)
        qk = apply_rope(qkv[..., : self.q_dim + c.kv_dim].reshape(B, T, c.n_heads + c.n_kv_heads, c.head_dim), rot)
        q, k = qk[:, :, : c.n_heads], qk[:, :, c.n_heads :]  # (B, T, H, D), (B, T, Hkv, D)
        v = qkv[..., self.q_dim + c.kv_dim :].reshape(B, T, c.n_kv_heads, c.head_dim)
        o = cache.attention(self.layer, q, k, v, x, pos)  # (B, T, H * D) f32
        h = h + linear(o, self.wo)
        x = F.rms_norm(h, (c.n_embd,), self.ffn_norm, c.rms_eps)
        gate, up = linear(x, self.w_gate_up).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, self.w_down)


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, n_ctx: int):
        super().__init__()
        self.c, self.dtype = c, dtype
        self.register_buffer("tok_embd", weights["token_embd.weight"].to(dtype), persistent=False)
        # Tied embeddings: without output.weight the head reuses token_embd (as llama.cpp does).
        out = weights.get("output.weight")
        self.register_buffer("untied_output", None if out is None else out.to(dtype), persistent=False)
        self.register_buffer("output_norm", weights["output_norm.weight"].float(), persistent=False)
        self.blocks = nn.ModuleList(Block(c, weights, i, dtype) for i in range(c.n_layers))
        self.register_buffer("rot", rope_table(c, n_ctx, weights.get("rope_freqs.weight")), persistent=False)

    @property
    def output(self) -> torch.Tensor:
        return self.tok_embd if self.untied_output is None else self.untied_output

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: Cache, pos: int, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions pos..pos+T-1 -> logits (B, T or 1, vocab) f32."""
        T = tokens.shape[1]
        h = self.tok_embd[tokens].float()  # (B, T, n_embd)
        rot = self.rot[pos : pos + T]
        for block in self.blocks:
            h = block(h, cache, pos, rot)
        if last_only:
            h = h[:, -1:]
        h = F.rms_norm(h, (self.c.n_embd,), self.output_norm, self.c.rms_eps)
        return linear(h, self.output)


def dtype_from_name(name: str) -> torch.dtype:
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]

