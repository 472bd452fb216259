"""On a CUDA machine: the Triton decode kernel of the CUDA weight forms (kvcli/kernels/weights.py)
checked against its reference, then timed against torch's f16 GEMV on Llama-2-7B's matrices
(4096 x 4096: q/k/v/o; 11008 x 4096: gate/up; 4096 x 11008: down).

    python benchmarks/gpu_weights.py         # checks + timings, under a minute
    python benchmarks/gpu_weights.py --dry   # tiny shapes on CPU under TRITON_INTERPRET=1: the
                                             # script's plumbing only, its times mean nothing

GB/s is the bytes a product reads (codes and scales; f16: the matrix) over its time. Each kernel
tile configuration (BLOCK_N, BLOCK_K, warps) is timed at one row, the best of them at 4 and 16
rows too. Prints figures only (never asserted in tests); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CONFIGS = [(16, 256, 4), (32, 256, 4), (8, 512, 4), (16, 512, 8), (32, 128, 4), (64, 256, 8)]


def blocks(bits: int, N: int, K: int, device: str, g):
    """A random Blocks form (random scales and mins: the check sees every field)."""
    import torch

    from kvcli.weights import Blocks

    scale = (torch.rand(N, K // 32, generator=g, device=device) * 1e-2 + 1e-3).half()
    if bits == 8:
        return Blocks(torch.randint(-128, 128, (N, K), generator=g, device=device, dtype=torch.int8), scale, None, 8)
    codes = torch.randint(0, 256, (N, K // 2), generator=g, device=device, dtype=torch.uint8)
    return Blocks(codes, scale, (torch.randn(N, K // 32, generator=g, device=device) * 1e-2).half(), 4)


def timed(fn, cuda: bool, reps: int) -> float:
    """Seconds per call: CUDA events around `reps` calls after a warm-up (CPU: the wall clock)."""
    import torch

    for _ in range(3 if cuda else 1):
        fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    args = ap.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import torch.nn.functional as F

    from kvcli.kernels.gpu.weights import weight_matmul

    cuda = not args.dry
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine (--dry runs its plumbing on CPU)")
        return 2
    device = "cuda" if cuda else "cpu"
    shapes = [(4096, 4096), (11008, 4096), (4096, 11008)] if cuda else [(96, 128), (64, 96)]
    configs = CONFIGS if cuda else CONFIGS[:2]
    reps = 100 if cuda else 1
    g = torch.Generator(device=device).manual_seed(0)
    ok = True
    print(f"decode products y = x @ W.T, {torch.cuda.get_device_name() if cuda else 'CPU, interpreter (dry run)'}")
    print(f"{'W (N x K)':12s} {'form':6s} {'rows':>4s} {'BN,BK,warps':>12s} {'us':>9s} {'GB/s':>8s} {'vs f16':>7s}  check")
    for N, K in shapes:
        w16 = torch.randn(N, K, generator=g, device=device).half() * 0.02
        xs = {M: torch.randn(M, K, generator=g, device=device) for M in (1, 4, 16)}
        t16 = {M: timed(lambda: F.linear(x.half(), w16), cuda, reps) for M, x in xs.items()}
        for M in xs:
            print(f"{f'{N} x {K}':12s} {'f16':6s} {M:4d} {'torch':>12s} {t16[M] * 1e6:9.1f} {2 * N * K / t16[M] / 1e9:8.1f}")
        for bits in (4, 8):
            form = blocks(bits, N, K, device, g)
            w = form.dequantize()
            best = None  # (seconds, config) at one row: the config the more rows use
            for M, x in xs.items():
                ref = x @ w.T
                bound = 1e-4 * (x.abs() @ w.abs().T) + 1e-20  # the same f32 products summed in another order
                for cfg in configs if best is None else [best[1]]:
                    run = lambda: weight_matmul(x, form.codes, form.scale, form.min, bits, *cfg)
                    good = bool(((run() - ref).abs() <= bound).all())
                    ok &= good
                    t = timed(run, cuda, reps)
                    print(f"{f'{N} x {K}':12s} {f'q{bits}':6s} {M:4d} {','.join(map(str, cfg)):>12s} {t * 1e6:9.1f} "
                          f"{form.nbytes / t / 1e9:8.1f} {t16[M] / t:6.2f}x  {'ok' if good else 'FAIL'}")
                    if M == 1 and (best is None or t < best[0]):
                        best = (t, cfg)
                if M == 1:
                    print(f"{'':12s} {f'q{bits}':6s} best at one row: {','.join(map(str, best[1]))}")
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
