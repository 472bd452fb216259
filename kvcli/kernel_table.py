"""The one kernel table, as ggml's `type_traits_cpu`: for each role, the kernels by (device, kind).

A role is one job with one signature for all its entries:
  ATTEND    attention over a K/V cache: run(q, cache, layer, pos, recent) -> (B, T, H * D) f32, as
            kvcli.attention.attend_reference (the entry every other one is tested against);
  HIDDEN    the same over a hidden-state cache (its K/V rebuilt from the stored x);
  QUANTIZE  quantize on write: run(layout, y (B, T, H, D) f32) -> the format's codes before they are laid out
            (a ggml type's blocks (B, T, H, row_bytes); a rotated type's codes and scales);
  WRITE     lay vectors into a store's bytes: run(layout, arrays, values, rows, pos) -> None, vector m of values[i]
            into arrays[i] (a layer's numpy views, Operands.arrays) at sequence rows[m], position pos[m] (a dense
            type's f32 (M, H, D), or a K and V pair of one dense type; a rotated type's codes and scales); its
            reference is the store's own torch writes (no run);
  PRODUCT   the weight product: run(form, x (..., K) f32) -> (..., N) f32, x @ W.T for a resident form;
  ROWS      dequantize rows: run(form, start, stop, dtype) -> W.T's slab (K, stop - start) of that dtype;
  NORM      RMSNorm: run(x, weight, eps) -> x / sqrt(mean(x^2) + eps) * weight;
  ROPE      RoPE in place: run(x (B, T, H, D), rot (T or B, T, D/2) complex, neox) -> None (kvcli/rope.py);
  SWIGLU    run(gu (..., 2F)) -> silu(gate) * up (..., F) (kvcli/swiglu.py).
The key of ATTEND is the pair of K and V layout kinds (kvcli.kernels.layout.Kind), of HIDDEN the x store's
kind, of QUANTIZE and WRITE a store's kind, of PRODUCT, ROWS a weight form's `kind`, of NORM, ROPE and SWIGLU the
dtype's name. The modules that own each role's glue (kvcli/attention.py, kvcli/weights.py, kvcli/rope.py,
kvcli/swiglu.py) register their entries here and are the only ones that ask; the leaves they call live in
kvcli/kernels/cpu/ and kvcli/kernels/gpu/.

The choice is made once per (role, device, key, shape) and machine (`choose` is cached), never per call:
the first registered entry whose device matches, whose instruction set this CPU has (the ISA levels below)
and that covers the shape; else the role's reference. `KVCLI_ISA=portable|avx2` hides what the CPU has above
that level (the switch CI on an AVX-512 machine uses to test what an AVX2 one runs); `KVCLI_TRITON=0` hides the
CUDA entries (the reference then runs on the GPU, to show the kernels' gain). Both are read once, at import.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field
from typing import Callable

ATTEND, HIDDEN, QUANTIZE, WRITE = "attend", "hidden", "quantize", "write"
PRODUCT, ROWS, NORM, ROPE, SWIGLU = "product", "rows", "norm", "rope", "swiglu"
ROLES = (ATTEND, HIDDEN, QUANTIZE, WRITE, PRODUCT, ROWS, NORM, ROPE, SWIGLU)

# Instruction-set levels, lowest first. PORTABLE: any CPU numba and torch run on (generic LLVM vectors);
# X86: SSSE3's byte shuffle (every x86-64 CPU with AVX has it); AVX2; AVX512: AVX-512 with VNNI and VBMI
# (byte dot products and two-table byte shuffles); BF16: AVX512-BF16 or AMX (bf16 products in hardware).
PORTABLE, X86, AVX2, AVX512, BF16 = "portable", "x86", "avx2", "avx512", "avx512_bf16"
_FLAGS_OF = {X86: {"ssse3"}, AVX2: {"avx2", "fma"}, AVX512: {"avx512f", "avx512_vnni", "avx512vbmi"}}
_ORDER = (PORTABLE, X86, AVX2, AVX512, BF16)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read): the project's one reader."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


@functools.cache
def isa_levels() -> tuple[str, ...]:
    """The ISA levels this run may use: what the CPU has, capped by KVCLI_ISA."""
    flags = cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    have = [PORTABLE]
    if x86 and _FLAGS_OF[X86] <= flags:
        have.append(X86)
    if x86 and _FLAGS_OF[AVX2] <= flags:
        have.append(AVX2)
    if x86 and _FLAGS_OF[AVX512] <= flags:
        have.append(AVX512)
    if {"avx512_bf16", "amx_bf16"} & flags:
        have.append(BF16)
    cap = os.environ.get("KVCLI_ISA", "").lower()
    if cap:
        if cap not in _ORDER:
            from kvcli.errors import KvcliError

            raise KvcliError(f"KVCLI_ISA={cap!r}: choose one of {', '.join(_ORDER)}")
        have = [level for level in have if _ORDER.index(level) <= _ORDER.index(cap)]
    return tuple(have)


def has(isa: str) -> bool:
    return isa in isa_levels()


TRITON_ON = os.environ.get("KVCLI_TRITON", "1") != "0"


def cpu_compiler() -> bool:
    """The CPU kernels' compiler (numba) is there: the `ready` of every compiled CPU entry (imported at the first
    call, so that the table and the roles' owners load without it)."""
    from kvcli.kernels.cpu.compile import available

    return available()


@dataclass(frozen=True)
class Entry:
    """One kernel of one role: where it runs, what it reads, what it needs, and the call."""

    role: str
    device: str  # "cpu" or "cuda"
    keys: frozenset  # the kinds it reads (ATTEND: (K kind, V kind) pairs; others: kinds)
    name: str  # where it lives (a file, and a word on how)
    run: Callable
    isa: str = PORTABLE  # the CPU level it needs (cpu entries)
    covers: Callable[..., bool] = field(default=lambda **shape: True)  # the shapes it takes, asked once per shape
    ready: Callable[[], bool] = field(default=lambda: True)  # its toolchain loads (numba, triton, a torch op)
    why: str = ""  # what it does that the reference does not, in a few words
    # its arithmetic against the reference, as the contract test holds it to: the largest error relative to the
    # output's scale (f32 kernels: f32 rounding; products on bf16 operands: bf16's)
    tol: float = 2e-5

    def runs_here(self, device: str) -> bool:
        if self.device != device:
            return False
        if device == "cuda":
            return TRITON_ON and self.ready()
        return has(self.isa) and self.ready()


_ENTRIES: list[Entry] = []
_REFERENCE: dict[str, Entry] = {}


def register(entry: Entry, reference: bool = False) -> Entry:
    """Add an entry (before those registered later: put the fastest first); reference: the role's truth,
    which runs on any device. Clears the choices made so far."""
    if entry.role not in ROLES:
        raise ValueError(f"unknown role {entry.role!r}")
    if reference:
        _REFERENCE[entry.role] = entry
    else:
        _ENTRIES.append(entry)
    _choose.cache_clear()
    return entry


def unregister(entry: Entry) -> None:
    """Take an entry out again (a test's toy entry)."""
    if entry in _ENTRIES:
        _ENTRIES.remove(entry)
    _choose.cache_clear()


def entries(role: str | None = None) -> list[Entry]:
    """Every registered entry of a role (or of all), references last."""
    out = [e for e in _ENTRIES if role is None or e.role == role]
    return out + [e for r, e in _REFERENCE.items() if role is None or r == role]


def reference(role: str) -> Entry:
    return _REFERENCE[role]


def choose(role: str, device: str, key, **shape) -> Entry:
    """The entry that runs `role` for `key` on `device` at this shape on this machine (the reference where no
    other does); made once per argument set."""
    return _choose(role, device, key, tuple(sorted(shape.items())))


@functools.cache
def _choose(role: str, device: str, key, shape: tuple) -> Entry:
    for e in _ENTRIES:
        if e.role == role and key in e.keys and e.runs_here(device) and e.covers(**dict(shape)):
            return e
    return _REFERENCE[role]


def why_not(entry: Entry, device: str) -> str:
    """Why an entry does not run on this machine ('' where it does)."""
    if entry.device != device:
        return f"for {entry.device}"
    if device == "cuda" and not TRITON_ON:
        return "KVCLI_TRITON=0"
    if device == "cpu" and not has(entry.isa):
        capped = os.environ.get("KVCLI_ISA")
        return f"needs {entry.isa}" + (f" (KVCLI_ISA={capped})" if capped else " (this CPU lacks it)")
    if not entry.ready():
        return "its toolchain does not load here"
    return ""
