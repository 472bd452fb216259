"""On a CUDA machine: check every Triton kernel against its reference on real shapes (with and
without a recent window), then time decode attention at depths 4096 and 32768 (one layer, Llama-3-8B
heads: 32 q / 8 kv, D = 128), and again with a 16-position window for the --window-types.

    python benchmarks/gpu_kernels.py            # checks + timings, about a minute
    python benchmarks/gpu_kernels.py --no-check # timings only

Prints figures only (never asserted in tests); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from kvcli.attention import Attention

H, HKV, D = 32, 8, 128


WINDOW = 16  # the recent window of the windowed checks and timings (q4_hadamard's default)


def tq_reference(store, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboStore.quantize's PyTorch branch (on CUDA the store runs the kernel): codes and scales of y."""
    from kvcli.cache.turbo import search_scales

    d, u = search_scales(y.reshape(*y.shape[:-1], -1, store.block_size), store.lv, store.steps, store.uniform,
                         store.signed)
    return u.view(y.shape), d.view(*y.shape[:-1], -1)


def decode_writes_same(kind: str, k: torch.Tensor, v: torch.Tensor) -> float:
    """tq's fused decode write (rotation, offset, scale search, packed bits) against the stores' PyTorch path
    (KVCLI_TRITON=0): a 100-token prefill through PyTorch in both, then 64 decode steps each way; the share
    of equal codes over the positions written."""
    from kvcli.cache import KVCache

    a, b = (KVCache(1, 1, HKV, 256, D, kind, kind, device="cuda", attention=Attention()) for _ in range(2))
    os.environ["KVCLI_TRITON"] = "0"
    try:
        for c in (a, b):
            c.store(0, k[:, :100], v[:, :100], 0)
        for p in range(100, 164):
            a.store(0, k[:, p : p + 1], v[:, p : p + 1], p)
    finally:
        del os.environ["KVCLI_TRITON"]
    for p in range(100, 164):
        b.store(0, k[:, p : p + 1], v[:, p : p + 1], p)
    return torch.cat([(x.codes(0, 100, 164) == y.codes(0, 100, 164)).flatten()
                      for x, y in ((a.k, b.k), (a.v, b.v))]).float().mean().item()


def check(types) -> bool:
    from kvcli.attention import attend_reference, attend_triton
    from kvcli.kernels.gpu.quantize import quantize_codes, quantize_into, quantize_tq
    from kvcli.cache import KVCache
    from kvcli.cache.ggml_blocks import quantize_reference
    from kvcli.cache.hadamard import quantize_vectors as quantize_codes_reference
    from kvcli.cache.turbo import TurboStore

    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    for kind in types:
        # quantize-on-write: a 512-token prefill of one layer, bytes against the PyTorch reference (on GPU)
        x = torch.randn(1, 512, HKV, D, device="cuda", generator=g) * 3
        cache = KVCache(1, 1, HKV, 1024, D, kind, kind, device="cuda", attention=Attention())
        tq = isinstance(cache.k, TurboStore)
        if kind == "q4_hadamard" or tq:  # codes and scales (the store packs them into its tiles)
            if tq:
                (u, d), (u_ref, d_ref) = quantize_tq(cache.k.kernel_layout(), x), tq_reference(cache.k, x)
            else:
                (u, d), (u_ref, d_ref) = quantize_codes(cache.k.kernel_layout(), x), quantize_codes_reference(x)
            same = torch.cat([(u == u_ref).flatten(), (d == d_ref).flatten()]).float().mean().item()
        else:
            dst = cache.k.data[0]
            out, ref = torch.zeros_like(dst), torch.zeros_like(dst)
            quantize_into(cache.k.kernel_layout(), x, out, 0)
            quantize_reference(kind, x, ref, 0)
            same = (out.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
        # attention: decode at depth 1000 and a 24-token prefill, kernel against the reference
        k, v = (torch.randn(1, 1000, HKV, D, device="cuda", generator=g) for _ in range(2))
        cache.store(0, k, v, 0)  # through the stores' CUDA branch (the kernels)
        q1 = torch.randn(1, 1, H, D, device="cuda", generator=g)
        qp = torch.randn(1, 24, H, D, device="cuda", generator=g)
        e1 = (attend_triton(q1, cache, 0, 999) - attend_reference(q1, cache, 0, 999)).abs().max().item()
        ep = (attend_triton(qp, cache, 0, 976) - attend_reference(qp, cache, 0, 976)).abs().max().item()
        # the recent window: a 1000-token prefill, then one decode step, each read through the kernel
        wc = KVCache(1, 1, HKV, 1024, D, kind, kind, device="cuda", window=WINDOW, attention=Attention())
        recent = wc.store(0, k, v, 0)
        qw = torch.randn(1, 1000, H, D, device="cuda", generator=g)
        ew = (attend_triton(qw, wc, 0, 0, recent) - attend_reference(qw, wc, 0, 0, recent=recent)).abs().max().item()
        recent = wc.store(0, k[:, :1], v[:, :1], 1000)
        ew = max(ew, (attend_triton(q1, wc, 0, 1000, recent)
                      - attend_reference(q1, wc, 0, 1000, recent=recent)).abs().max().item())
        if tq:  # decode's fused write: the share of equal codes counts in `same`
            same = min(same, decode_writes_same(kind, k, v))
        # tq's 64-term sums: torch's CUDA order and tl.sum's can flip a near-tie of two candidate scales
        good = same >= (0.999 if tq else 1.0) and e1 < 1e-3 and ep < 1e-3 and ew < 1e-3
        ok &= good
        print(f"{kind:12s} quantize bytes equal {same * 100:8.4f}%   decode max|err| {e1:.2e}   "
              f"prefill max|err| {ep:.2e}   window max|err| {ew:.2e}   {'ok' if good else 'FAIL'}")
    return ok


def timed(fn, reps: int = 50) -> float:
    """Seconds per call on the GPU (gpu_weights.timed: CUDA events after a warm-up)."""
    from gpu_weights import timed as timed_on  # benchmarks/ is the script's folder, so on the path

    return timed_on(fn, True, reps)


def bench(types, depths, window_types=()) -> None:
    from kvcli.attention import attend_reference, attend_triton
    from kvcli.cache import KVCache

    print(f"\ndecode attention, one layer, B=1, {H} q heads / {HKV} kv heads, D={D}, {torch.cuda.get_device_name()}")
    print(f"{'type':16s} {'depth':>6s} {'kernel us':>10s} {'GB/s':>8s} {'reference us':>13s} {'layer-tok/s':>12s}")
    for depth in depths:
        for kind, window in [(t, 0) for t in types] + [(t, WINDOW) for t in window_types]:
            cache = KVCache(1, 1, HKV, depth + 1, D, kind, kind, device="cuda", window=window, attention=Attention())
            for c0 in range(0, depth - 1, 4096):  # fill in chunks (bounded scratch)
                n = min(4096, depth - 1 - c0)
                cache.store(0, torch.randn(1, n, HKV, D, device="cuda"), torch.randn(1, n, HKV, D, device="cuda"), c0)
            pos = depth - 1  # the decode step: its own K/V stored, then attention over all
            recent = cache.store(0, torch.randn(1, 1, HKV, D, device="cuda"), torch.randn(1, 1, HKV, D, device="cuda"),
                                 pos)
            q = torch.randn(1, 1, H, D, device="cuda")
            t = timed(lambda: attend_triton(q, cache, 0, pos, recent))
            t_ref = timed(lambda: attend_reference(q, cache, 0, pos, recent=recent), reps=5)
            read = cache.nbytes() * depth / (depth + 1)  # K and V bytes of the positions attended (window included)
            name = f"{kind}+w{window}" if window else kind
            print(f"{name:16s} {depth:6d} {t * 1e6:10.1f} {read / t / 1e9:8.1f} {t_ref * 1e6:13.1f} {1 / t:12.0f}")
    # a bandwidth yardstick: torch's fused attention over a dense f16 K/V (repeated for GQA)
    for depth in depths:
        k = torch.randn(1, H, depth, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.float16)
        t = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"{'sdpa f16 MHA':16s} {depth:6d} {t * 1e6:10.1f} {2 * k.numel() * 2 / t / 1e9:8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--depths", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0", "q4_hadamard", "tq4", "tq3", "tq2"])
    ap.add_argument("--window-types", nargs="*", default=["q8_0", "q4_hadamard", "tq3"],
                    help=f"types timed again with a {WINDOW}-position recent window read by the kernel")
    ap.add_argument("--check-types", nargs="*", help="the kernel types checked (default: every type a kernel reads)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine")
        return 2
    t0 = time.time()
    from kvcli.cache import STORAGE_TYPES

    kernel_types = [n for n, cls in STORAGE_TYPES.items() if cls(1, 1, 1, 1, D).kernel_layout() is not None]
    ok = True if args.no_check else check(args.check_types or kernel_types)
    bench(args.types, args.depths, args.window_types)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
