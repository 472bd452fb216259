"""The Llama decoder: RMSNorm, RoPE, GQA attention, SwiGLU; Qwen2/Qwen3 as switches of it.

It knows nothing of cache formats: each block hands q, its new K/V and its normed input x
to `cache.attention`, which stores what its format keeps (K/V, or x for the hidden-state
cache) and returns the attention output over what the cache holds.
The residual stream, norms, RoPE and softmax run in f32; matrices are resident forms
(kvcli/weights.py: packed int4/int8 codes or dense tensors) whose `matmul` takes and returns f32.
Per architecture (kvcli.config.ARCH_TRAITS, as llama.cpp's graphs): qwen2 adds attn_{q,k,v}.bias,
qwen3 RMS-normalises each Q and K head (attn_{q,k}_norm) before RoPE; both rotate NEOX pairs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvcli.cache.base import Cache
from kvcli.config import ModelConfig
from kvcli.rms_norm import rms_norm
from kvcli.weights import Dense, cat


def yarn_theta(c: ModelConfig, theta: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (ggml's rope_yarn, ext_factor = c.yarn_ext_factor): dims that turn more than
    beta_fast times in the original context keep theta (extrapolate), fewer than beta_slow take
    theta / factor (interpolate), a linear ramp between. theta (D/2,) f64 -> (D/2,) f64."""
    D = c.head_dim

    def corr_dim(n_rot: float) -> float:  # ggml_rope_yarn_corr_dim: the dim whose wavelength fits n_rot turns
        return D * math.log(c.yarn_orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(c.rope_base))

    low, high = max(0.0, math.floor(corr_dim(c.yarn_beta_fast))), min(D - 1.0, math.ceil(corr_dim(c.yarn_beta_slow)))
    j = torch.arange(D // 2, dtype=torch.float64)
    mix = (1 - ((j - low) / max(0.001, high - low)).clamp(0, 1)) * c.yarn_ext_factor  # 1: extrapolate
    return theta / c.rope_scale_factor * (1 - mix) + theta * mix


def rope_table(c: ModelConfig, n_ctx: int, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """(n_ctx, head_dim/2) complex64 rotations m * e^{i * pos * theta_j}, theta_j = base^(-2j/D), scaled as
    c.rope_scaling says (llama.cpp's order: rope_freqs.weight first, then linear or YaRN); m = YaRN's mscale or 1."""
    theta = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    if freq_factors is not None:  # llama3-style rope_freqs.weight divides each frequency
        theta = theta / freq_factors.double()
    if c.rope_scaling == "yarn":
        theta = yarn_theta(c, theta)
    elif c.rope_scaling == "linear":  # positions divided by the factor
        theta = theta / c.rope_scale_factor
    angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64), theta).float()
    mscale = c.yarn_mscale if c.rope_scaling == "yarn" else 1.0  # on cos and sin: q.k scaled by mscale^2
    return torch.polar(torch.full_like(angles, mscale), angles)


def rope_(x: torch.Tensor, rot: torch.Tensor, neox: bool = False) -> None:
    """RoPE in place on x (B, T, H, D) f32, a view whose last dimension is contiguous; rot (T, D/2) complex,
    shared by the B rows (the server's step: each token's own row of the table), or (B, T, D/2), each row
    its own positions.

    Which dims rotate together is the one layout choice: GGUF llama files pair (2i, 2i+1) (llama.cpp's
    converter permutes Q/K rows to Meta's layout); qwen2/qwen3 files keep Hugging Face's rows and pair
    (i, i + D/2) (rotate_half; llama.cpp's NEOX mode). Decode's few ops per layer: one complex multiply
    (adjacent) or four real ones (neox) into the fused q/k/v product."""
    if not neox:
        xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, T, H, D/2)
        xc.mul_(rot.unsqueeze(-2))  # (..., T, 1, D/2): one rotation for every head
        return
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)  # (B, T, H, D/2) each, views of x
    cos, sin = rot.real.unsqueeze(-2), rot.imag.unsqueeze(-2)
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin


def apply_rope(x: torch.Tensor, rot: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """rope_ on a copy: x (B, T, H, D) f32 -> rotated (B, T, H, D) f32."""
    x = x.clone(memory_format=torch.contiguous_format)
    rope_(x, rot, neox)
    return x


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
        # qwen2: one f32 bias for the fused q,k,v rows; qwen3: each Q head's and K head's norm weight, (H + Hkv, D)
        bqkv = torch.cat([w.pop(p + f"attn_{n}.bias").float() for n in "qkv"]) if c.qkv_bias else None
        self.register_buffer("bqkv", bqkv, persistent=False)
        qk_norm = torch.cat([w.pop(p + "attn_q_norm.weight").float().expand(c.n_heads, -1),
                             w.pop(p + "attn_k_norm.weight").float().expand(c.n_kv_heads, -1)]) if c.qk_norm else None
        self.register_buffer("qk_norm", qk_norm, persistent=False)
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

    @property
    def bv(self) -> torch.Tensor | None:
        """V's bias per KV head, (Hkv, D) f32, or None: the hidden-state cache adds it to rebuilt values."""
        return None if self.bqkv is None else self.bqkv[self.q_dim + self.c.kv_dim :].view(self.c.n_kv_heads, -1)

    @property
    def linear_kv(self) -> bool:
        """K = adjacent-pair RoPE(x Wk) and V = x Wv, nothing more: what the hidden decode kernel rebuilds."""
        return not (self.c.rope_neox or self.c.qkv_bias or self.c.qk_norm)

    def forms(self) -> dict:
        return {"wqkv": self.wqkv, "wo": self.wo, "w_gate_up": self.w_gate_up, "w_down": self.w_down}

    def project_k(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """K = RoPE(x Wk + bk) (each head RMS-normed first where qk_norm) for normed inputs x (B, n, n_embd) f32
        at rot's n positions -> (B, n, Hkv, D) f32, computed as forward computes it: the hidden-state cache
        rebuilds K so."""
        c = self.c
        k = self.wk.matmul(x)  # (B, n, kv_dim)
        if self.bqkv is not None:
            k = k + self.bqkv[self.q_dim : self.q_dim + c.kv_dim]
        k = k.unflatten(-1, (c.n_kv_heads, c.head_dim))  # (B, n, Hkv, D)
        if self.qk_norm is not None:
            k = F.rms_norm(k, (c.head_dim,), eps=c.rms_eps) * self.qk_norm[c.n_heads :]
        return apply_rope(k, rot, c.rope_neox)

    def forward(self, h: torch.Tensor, cache: Cache, pos: int, rot: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = h.shape  # h: (B, T, n_embd) f32 residual stream
        x = rms_norm(h, self.attn_norm, c.rms_eps)
        qkv = self.wqkv.matmul(x)  # (B, T, (H + 2*Hkv) * D)
        if self.bqkv is not None:  # qwen2
            qkv.add_(self.bqkv)
        qkv = qkv.view(B, T, c.n_heads + 2 * c.n_kv_heads, c.head_dim)  # (B, T, H + 2*Hkv, D)
        qk = qkv[:, :, : c.n_heads + c.n_kv_heads]
        if self.qk_norm is not None:  # qwen3: each q and k head RMS-normed over its D dims
            qk.copy_(F.rms_norm(qk, (c.head_dim,), eps=c.rms_eps) * self.qk_norm)
        rope_(qk, rot, c.rope_neox)  # q and k rotated where they lie: no copies
        q, k, v = qkv.split((c.n_heads, c.n_kv_heads, c.n_kv_heads), 2)  # (B, T, H, D), (B, T, Hkv, D) x 2
        o = cache.attention(self.layer, q, k, v, x, pos)  # (B, T, H * D) f32
        h = h + self.wo.matmul(o)
        x = rms_norm(h, self.ffn_norm, c.rms_eps)
        gate, up = self.w_gate_up.matmul(x).chunk(2, dim=-1)
        return h + self.w_down.matmul(F.silu(gate) * up)


class _Slots:
    """Several one-sequence caches as one for Block.forward: a (1, sum n_i, ...) batch whose i-th segment of
    n_i tokens goes to caches[i] at positions[i].., and each cache stores and attends as it would alone (every
    cache type, window and kernel unchanged). The block's projections, norms and MLP run over the whole batch.
    Decode tokens (n_i = 1) of consecutive rows of one cache (KVCache.rows: the server's slots) attend
    as one batch through a view of those rows, each at its own position: one set of ops, not one a slot."""

    def __init__(self, caches: list, positions: list[int], lengths: list[int]):
        self.runs: list[tuple] = []  # (cache, pos, first token, tokens); pos a (k,) tensor for k rows' decode tokens
        group: list[tuple] = []  # decode segments (cache, pos, first token) of consecutive rows of one cache
        a = 0
        for c, p, n in zip(caches, positions, lengths):
            row = n == 1 and getattr(c, "base", None) is not None
            if group and not (row and c.base is group[0][0].base and c.row0 == group[-1][0].row0 + 1):
                self._close(group)
            if row:
                group.append((c, p, a))
            else:
                self.runs.append((c, p, a, n))
            a += n
        self._close(group)

    def _close(self, group: list[tuple]) -> None:
        if len(group) == 1:
            c, p, a = group[0]
            self.runs.append((c, p, a, 1))
        elif group:
            c, _, a = group[0]
            pos = torch.tensor([p for _, p, _ in group], device=c.k.data.device)
            self.runs.append((c.base.rows(c.row0, c.row0 + len(group)), pos, a, len(group)))
        group.clear()

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """q (1, N, H, D), k/v (1, N, Hkv, D), x (1, N, n_embd) -> (1, N, H * D); pos unused (each segment's own)."""
        out = []
        for c, p, a, n in self.runs:
            if torch.is_tensor(p):  # n sequences, a token each: (n, 1, ...) views
                rows = [t.transpose(0, 1) if n == t.shape[1] else t[0, a : a + n, None] for t in (q, k, v, x)]
                out.append(c.attention(layer, *rows, p).view(1, n, -1))
            else:
                out.append(c.attention(layer, q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], x[:, a : a + n], p))
        return out[0] if len(out) == 1 else torch.cat(out, 1)  # one run (all rows decoding): no copy


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
        h = rms_norm(h, self.output_norm, self.c.rms_eps)
        return self.output.matmul(h)

    @torch.inference_mode()
    def forward_slots(self, ids: list[list[int]], caches: list, positions: list[int]) -> torch.Tensor:
        """One step of several independent sequences (llama-server's one batch per step): ids[i], tokens appended
        to the sequence in caches[i] (one sequence each) at positions[i].., a prompt chunk or one decode token
        -> logits (len(ids), vocab) f32 of each one's last token. All but attention runs once over every token
        (the weights are read once a step); RoPE takes each token's own position (rows of self.rot)."""
        lengths = [len(t) for t in ids]
        dev = self.rot.device
        tokens = torch.tensor([[t for seg in ids for t in seg]], dtype=torch.long, device=dev)  # (1, N)
        where = torch.tensor([p + j for p, n in zip(positions, lengths) for j in range(n)], device=dev)
        h = self.tok_embd.rows(tokens)  # (1, N, n_embd) f32
        rot = self.rot[where]  # (N, D/2): each token at its own position
        slots = _Slots(caches, positions, lengths)
        for block in self.blocks:
            h = block(h, slots, 0, rot)
        h = h[:, torch.tensor(lengths, device=dev).cumsum(0) - 1]  # (1, len(ids), n_embd): each one's last token
        h = rms_norm(h, self.output_norm, self.c.rms_eps)
        return self.output.matmul(h)[0]


def dtype_from_name(name: str) -> torch.dtype:
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]

