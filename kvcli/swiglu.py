"""SwiGLU, silu(gate) * up, of the fused gate/up product (Block's feed-forward), through the SWIGLU entry chosen once per
device and dtype (kvcli/kernel_table.py): on the CPU for f32 one compiled pass (kvcli/kernels/cpu/swiglu.py), the
reference torch's ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcli import kernel_table as table
from kvcli.kernel_table import SWIGLU, Entry


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu (..., 2F) f32, gate then up -> silu(gate) * up (..., F)."""
    key = (gu.device.type, gu.dtype)
    run = _RUNS.get(key)
    if run is None:
        run = _RUNS[key] = table.choose(SWIGLU, key[0], str(gu.dtype).removeprefix("torch.")).run
    return run(gu)


def _swiglu_reference(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


# Rows from which a batch's SwiGLU is split over the threads (a decode step's few rows stay in the calling thread)
THREADED_ROWS = 16


def _swiglu_numba(gu: torch.Tensor) -> torch.Tensor:
    from kvcli.kernels.cpu import swiglu as kernels

    rows = gu.reshape(-1, gu.shape[-1]).numpy()
    out = kernels.rows_out(rows, torch.get_num_threads() if rows.shape[0] >= THREADED_ROWS else 1)
    return torch.from_numpy(out).view(*gu.shape[:-1], gu.shape[-1] // 2)


def compiled_on_cpu() -> bool:
    """Does SwiGLU on the CPU in f32 run the compiled pass (what the compiled decode layer calls)?"""
    return table.choose(SWIGLU, "cpu", "float32").run is _swiglu_numba


_RUNS: dict = {}  # (device, dtype) -> the SWIGLU entry's run, chosen at the first call
table.register(Entry(SWIGLU, "cpu", frozenset({"float32"}), "kvcli/kernels/cpu/swiglu.py (numba, one pass)",
                     _swiglu_numba, ready=table.cpu_compiler, tol=1e-6,
                     why="one call where torch's takes three ops"))
table.register(Entry(SWIGLU, "any", frozenset(), "kvcli/swiglu.py: torch's F.silu and a product", _swiglu_reference),
               reference=True)
