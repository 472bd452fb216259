"""Keys scaled for the queries that read them (issue 41): a per-channel change of basis of a layer's keys, undone in
its queries, chosen from the model's weights so that a quantized key store puts its error where the queries look
least.

A score is q . k = (q * s) . (k / s) for any s > 0 per channel. A rotated store (kvcli/cache/hadamard.py, turbo.py)
spreads its error evenly over the channels of what it stores, k / s: E[e_j^2] = sigma^2 with sigma^2 proportional
to sum_j a_j / s_j^2, a_j = E[k_j^2] of the keys as stored. The score's error (q * s) . e has the variance
sigma^2 sum_j b_j s_j^2, b_j = E[q_j^2] over the queries of the K head's group. The product is least at
s_j^2 = sqrt(a_j / b_j) (Cauchy-Schwarz), where it is (sum_j sqrt(a_j b_j))^2 against sum_j a_j sum_j b_j at s = 1:
`gain`, the predicted share of the score error left.

s is one value on each RoPE pair (the two channels a rotation mixes; a and b averaged over the pair), so it commutes
with RoPE: the keys, their turning mean (kvcli/cache/key_bias.py) and the K bias scale alike at every position, and
the cache simply works in the scaled basis: KVCache.attention takes q * s and k / s (the compiled decode layer
the same, kvcli/kernels/cpu/decode_layer.py `front`), exact up to rounding for any type.

a and b come from the weights alone, the block's normed input taken as uncorrelated channels of unit power:
E[(W x + c)_j^2] = sum_i (W_ji g_i)^2 + c_j^2, g the attention norm's weight, c the bias (the queries' only: the
keys' mean takes theirs out); with a per-head norm (qwen3) each head's share of its power, times the norm's weight
squared. On Qwen2.5-Coder-0.5B the log-ratio log(a/b) from the weights correlates 0.81-0.98 per layer with the same
from 512 tokens of WikiText, and the KLD it gives is within 8% of the measured statistics' (benchmarks/README.md).

auto: where the weights predict a gain of at most GAIN_RULE, averaged over layers and heads, on kvcli's rotated key
types (Qwen2.5-Coder-0.5B: 0.57, SmolLM2-135M: 0.96). The scales are the model's (a few floats per channel), not
the cache's: they are not counted in its bytes, as the RoPE table is not.
"""

from __future__ import annotations

import weakref

import torch

KEY_SCALES = ("auto", "on", "off")
GAIN_RULE = 0.85  # auto scales keys where the weights predict at most this share of the score error left
ROWS = 256  # weight rows dequantized at a time
RATIO = 1e6  # a / b clamped to [1 / RATIO, RATIO]: channels a query never reads do not blow up s

_found: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (scales (L, H + Hkv, D), gain (L, Hkv))


def _power(form, start: int, stop: int, g2: torch.Tensor) -> torch.Tensor:
    """sum_i (W_ji g_i)^2 of rows start..stop-1 of a resident form: (stop - start,) f32."""
    out = [(form.rows(torch.arange(i, min(i + ROWS, stop))).float().cpu().square() @ g2) for i in range(start, stop, ROWS)]
    return torch.cat(out)


def pair_mean(x: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (..., D) averaged over each RoPE pair, (..., D): (j, j + D/2) for NEOX, else (2j, 2j+1)."""
    D = x.shape[-1]
    if neox:
        h = (x[..., : D // 2] + x[..., D // 2 :]) / 2
        return torch.cat([h, h], -1)
    return x.view(*x.shape[:-1], D // 2, 2).mean(-1, keepdim=True).expand(*x.shape[:-1], D // 2, 2).reshape(x.shape)


def block_scales(block, c) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's multipliers (H + Hkv, D) f32 (q heads' s, then the K heads' 1 / s) and gain (Hkv,)."""
    H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
    g2 = block.attn_norm.float().cpu().square()
    q = _power(block.wqkv, 0, H * D, g2).view(H, D)
    k = _power(block.wqkv, H * D, (H + Hkv) * D, g2).view(Hkv, D)
    if block.bqkv is not None:  # qwen2's q bias is part of every query
        q = q + block.bqkv[: H * D].float().cpu().view(H, D).square()
    if block.qk_norm is not None:  # qwen3: each head RMS-normed, then times the norm's weight
        norm = block.qk_norm.float().cpu().square()
        q = q / q.sum(-1, keepdim=True) * norm[:H]
        k = k / k.sum(-1, keepdim=True) * norm[H:]
    a = pair_mean(k, c.rope_neox).clamp_min(1e-30)  # (Hkv, D)
    b = pair_mean(q.view(Hkv, H // Hkv, D).mean(1), c.rope_neox).clamp_min(1e-30)
    s = (a / b).clamp(1 / RATIO, RATIO).pow(0.25)
    s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per head: the stored keys keep their size
    gain = (a * b).sqrt().sum(-1).square() / (a.sum(-1) * b.sum(-1))
    return torch.cat([s.repeat_interleave(H // Hkv, 0), 1 / s]), gain


def model_scales(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's multipliers (L, H + Hkv, D) and gain (L, Hkv) of a Transformer (kvcli/model.py), made once."""
    if model not in _found:
        found = [block_scales(b, model.c) for b in model.blocks]
        _found[model] = (torch.stack([s for s, _ in found]), torch.stack([g for _, g in found]))
    return _found[model]


def scales_keys(policy: str, k_type, model) -> bool:
    """Does a cache with --key-scales `policy` scale keys of this storage type (a Store class) on this model?
    auto: kvcli's rotated types where the weights predict a gain of GAIN_RULE or better; on: every type; off: none."""
    if policy == "off" or model is None or not model.blocks:
        return False
    if policy == "on":
        return True
    return bool(k_type.rotated and not k_type.dense and model_scales(model)[1].mean() <= GAIN_RULE)

