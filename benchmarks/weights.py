"""Resident weight forms (kvcli/weights.py) on SmolLM2-135M's shapes: one-row product time per
form against the f16 GEMV, the Q8_0 head's kernel options, fused vs separate q/k/v, and the
bf16 rounding of Q4_1 scales and zero points on the default model.

    python benchmarks/weights.py [-t THREADS]
"""

import argparse
import time

import torch

from kvcli.gguf_file import open_gguf, read_tensor
from kvcli.models import default_model_path
from kvcli.weights import Dense, Int4, Int8, cat, load

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536), "head": (49152, 576)}


def best_us(f, n=20, reps=5):
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"one-row product, us (best of 5; {args.threads} threads)")
    print(f"{'matrix':10} {'N x K':>11} {'f16':>8} {'int4':>8} {'int8':>8}")
    for name, (N, K) in SHAPES.items():
        codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        scale = torch.rand(N, K // 32, generator=g) * 0.01
        i4 = Int4.from_codes(codes, scale, torch.zeros_like(scale))
        i8 = Int8.from_codes(torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8), scale.half())
        f16 = Dense(i4.dequantize().half())
        x = torch.randn(1, K, generator=g)
        n = 5 if N > 10000 else 50
        print(f"{name:10} {N:>5} x {K:<4} {best_us(lambda: f16.matmul(x), n):8.0f} "
              f"{best_us(lambda: i4.matmul(x), n):8.0f} {best_us(lambda: i8.matmul(x), n):8.0f}")

    # fused q/k/v (one int4 product) against three
    parts = [Int4.from_codes(torch.randint(0, 16, (n, 576), generator=g, dtype=torch.uint8),
                             torch.rand(n, 18, generator=g), torch.zeros(n, 18)) for n in (576, 192, 192)]
    fused, x = cat(parts), torch.randn(1, 576, generator=g)
    print(f"q/k/v int4: fused {best_us(lambda: fused.matmul(x), 50):.0f} us, "
          f"separate {best_us(lambda: [p.matmul(x) for p in parts], 50):.0f} us")

    # Q8_0 head options: per-block int8 GEMV (kept), one int8 GEMV at per-row scale (inexact, a floor)
    N, K = SHAPES["head"]
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    ones = torch.ones(N, dtype=torch.bfloat16)
    xb = x.bfloat16()
    print(f"head int8, one call at per-row scales (not exact, a floor): "
          f"{best_us(lambda: torch.ops.aten._weight_int8pack_mm(xb, q, ones), 5):.0f} us; "
          f"f32 activations: {best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q, ones.float()), 5):.0f} us")

    # bf16 rounding of the default model's Q4_1 scales and zero points: products vs the file's f32 values
    m = open_gguf(default_model_path())
    errs = []
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.15.attn_k.weight",
                 "blk.29.ffn_up.weight"):
        form, w = load(m.tensors[name], "int4"), torch.from_numpy(read_tensor(m, name))
        xs = torch.randn(64, w.shape[1], generator=g)
        exact, got = xs @ w.T, xs @ form.dequantize().T
        rel = (got - exact).abs() / (xs.abs() @ w.abs().T)  # error per unit of sum |x w|: the bf16 scale
        errs.append((name, rel.max().item(), rel.mean().item(), (got - exact).norm().item() / exact.norm().item()))
    print("bf16 scale/zero rounding, Q4_1 products vs exact f32 (x ~ N(0,1), 64 rows), error / sum|x||w|:")
    for name, mx, mean, fro in errs:
        print(f"  {name:24} max {mx:.2e}  mean {mean:.2e}  ||err||/||y|| {fro:.2e}")


if __name__ == "__main__":
    main()
