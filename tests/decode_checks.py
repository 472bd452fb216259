"""What the CPU decode kernels' tests share (tests/test_dense_decode.py, tests/test_hadamard_decode.py)."""

from __future__ import annotations

import torch

from kvcli.attention import Attention, attend_reference


def decode(q: torch.Tensor, cache, layer: int, pos, recent=None, module: str = "") -> torch.Tensor:
    """Attention()'s result for a decode step, checking that the kernel table chose the CPU kernel of `module`
    (kvcli/kernels/cpu/<module>.py) for this cache."""
    out = Attention()(q, cache, layer, pos, recent)
    run = cache.kernels[(True, torch.is_tensor(pos), "cpu", True)]
    assert getattr(run, "module", None) == module, f"{getattr(run, 'module', run)} ran, not {module}"
    return out


def rows_match_reference(monkeypatch, kernel, cache, lens: list[int], steps: int, g: torch.Generator,
                         groups: int = 3) -> None:
    """Rows b at positions lens[b] + step decode `steps` tokens in layer 1: Attention() (through `kernel`, the
    module whose `attend` must run every step) equals the reference (keys an offset away from 0, as real
    keys are)."""
    B, H, D = len(lens), cache.k.n_heads, cache.k.head_dim
    called = []
    monkeypatch.setattr(kernel, "attend", lambda *a, f=kernel.attend: called.append(1) or f(*a))
    for step in range(steps):
        pos = torch.tensor([n + step for n in lens])
        q = torch.randn(B, 1, H * groups, D, generator=g) * 3
        recent = cache.store(1, torch.randn(B, 1, H, D, generator=g) * 2 + 0.5, torch.randn(B, 1, H, D, generator=g),
                             pos)
        got = Attention()(q, cache, 1, pos, recent)
        want = attend_reference(q, cache, 1, pos, recent=recent)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert len(called) == steps  # the kernel ran, not the reference twice
