"""RoPE (Su et al., 2021): the rotation table, scaled as the GGUF says (linear, YaRN, llama3's rope_freqs),
and the rotation itself in the two pair layouts GGUF files use. The model rotates q and k with it, and the
hidden-state cache (kvcli/cache/hidden.py) rotates the K it rebuilds the same way."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcli import kernel_table as table
from kvcli.config import ModelConfig
from kvcli.kernel_table import ROPE, Entry


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
    (i, i + D/2) (rotate_half; llama.cpp's NEOX mode). Through the ROPE entry chosen once per device and dtype
    (on the CPU for f32: kvcli/kernels/cpu/rope.py, one compiled pass, the reference's bits)."""
    key = (x.device.type, x.dtype)
    run = _ROPES.get(key)
    if run is None:
        run = _ROPES[key] = table.choose(ROPE, key[0], str(x.dtype).removeprefix("torch.")).run
    run(x, rot, neox)


def _rope_reference(x: torch.Tensor, rot: torch.Tensor, neox: bool) -> None:
    """ROPE's reference (torch ops): one complex multiply (adjacent) or four real ones (neox) into x."""
    if not neox:
        xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, T, H, D/2)
        xc.mul_(rot.unsqueeze(-2))  # (..., T, 1, D/2): one rotation for every head
        return
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)  # (B, T, H, D/2) each, views of x
    cos, sin = rot.real.unsqueeze(-2), rot.imag.unsqueeze(-2)
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin


def _rope_numba(x: torch.Tensor, rot: torch.Tensor, neox: bool) -> None:
    r = rot.numpy()
    r = r[None] if r.ndim == 2 else r  # (1 or B, T, D/2)
    if (x.dim() != 4 or r.ndim != 3 or r.dtype != np.complex64 or r.shape[0] not in (1, x.shape[0])
            or r.shape[1] != x.shape[1] or 2 * r.shape[2] != x.shape[3]):  # a broadcast the kernel does not make
        return _rope_reference(x, rot, neox)
    from kvcli.kernels.cpu import rope as kernel

    kernel.rotate(x.numpy(), r, neox)


def compiled_on_cpu() -> bool:
    """Does RoPE on the CPU in f32 run the compiled pass (what the compiled decode layer calls, kvcli/decode_layer.py)?"""
    return table.choose(ROPE, "cpu", "float32").run is _rope_numba


_ROPES: dict = {}  # (device, dtype) -> the ROPE entry's run, chosen at the first call
table.register(Entry(ROPE, "cpu", frozenset({"float32"}), "kvcli/kernels/cpu/rope.py (numba, one pass)", _rope_numba,
                     ready=table.cpu_compiler, why="one call where torch's takes four to six ops, its bits"))
table.register(Entry(ROPE, "any", frozenset(), "kvcli/rope.py: torch ops", _rope_reference), reference=True)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """rope_ on a copy: x (B, T, H, D) f32 -> rotated (B, T, H, D) f32."""
    x = x.clone(memory_format=torch.contiguous_format)
    rope_(x, rot, neox)
    return x
