"""Resident weight forms (kvcli/weights.py) on SmolLM2-135M's shapes: one-row product time per
form against the f16 GEMV, the Q8_0 head's kernel options, fused vs separate q/k/v, and the
bf16 rounding of the int4 form's scales and zero points: the default model's Q4_1 matrices and
the Q4_K matrices of --q4k (default: the tiny random tests/data/tiny-Q4_K_M.gguf).

    python benchmarks/weights.py [-t THREADS] [--q4k MODEL.gguf]
"""

import argparse
import time
from pathlib import Path

import torch

from kvcli.gguf_file import open_gguf, read_tensor
from kvcli.catalog import default_model_path
from kvcli.weights import Dense, Int4, Int8, cat, load

TINY_Q4_K = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-Q4_K_M.gguf"
ROUNDING_NAMES = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.15.attn_k.weight",
                  "blk.29.ffn_up.weight")
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
    ap.add_argument("--q4k", type=Path, default=TINY_Q4_K, help="a GGUF holding Q4_K matrices")
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

    # Q8_0 head options, 1 and 4 rows: the kept form (the codes as two int4 halves, one int4 call per
    # 64 columns, Int8.chunk), the same halves in one call over all of K (its bf16 output ties top logits),
    # the per-block int8 GEMV (one call per 32 columns with that block's scales: the form before stop 28),
    # one int8 call at per-row scales (inexact, a floor)
    N, K = SHAPES["head"]
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half()
    head = Int8.from_codes(q, d)
    u = q.view(torch.uint8) ^ 128
    df = d.float()
    one_call = Int4.from_codes(torch.cat([u >> 4, u & 15], 1), torch.cat([16 * df, df], 1),
                               torch.cat([8 * df, torch.zeros_like(df)], 1))
    qb = q.view(N, K // 32, 32).transpose(0, 1).contiguous()  # (K / 32, N, 32)
    db = d.T.bfloat16().contiguous()
    ones = torch.ones(N, dtype=torch.bfloat16)

    def per_block(xb):
        out = torch.ops.aten._weight_int8pack_mm(xb[0], qb[0], db[0]).float()
        for b in range(1, K // 32):
            out += torch.ops.aten._weight_int8pack_mm(xb[b], qb[b], db[b])
        return out

    print("head (49152 x 576, Q8_0), us:   1 row   4 rows")
    for name, f in (("int4 halves, a call per chunk (kept)", lambda x: head.matmul(x)),
                    ("int4 halves, one call", lambda x: one_call.matmul(torch.cat([x, x], -1))),
                    ("int8 GEMV per block", lambda x: per_block(x.bfloat16().view(-1, K // 32, 32).transpose(0, 1).contiguous())),
                    ("int8, one call, per-row scales (floor)", lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, ones))):
        print(f"  {name:40} " + " ".join(f"{best_us(lambda: f(torch.randn(m, K, generator=g)), 5):7.0f}" for m in (1, 4)))

    rounding(default_model_path(), "Q4_1", g)
    rounding(args.q4k, "Q4_K", g)


def rounding(path, ggml_type: str, g: torch.Generator, count: int = 5):
    """bf16 rounding of the int4 form's scales and zero points (the only change from the file's values):
    products of up to `count` of the file's `ggml_type` matrices (ROUNDING_NAMES first) against its exact
    f32 values."""
    m = open_gguf(path)
    typed = [n for n, t in m.tensors.items() if t.tensor_type.name == ggml_type and len(t.shape) == 2]
    names = ([n for n in ROUNDING_NAMES if n in typed] + [n for n in typed if n not in ROUNDING_NAMES])[:count]
    print(f"bf16 scale/zero rounding, {ggml_type} products vs exact f32 ({Path(path).name}; x ~ N(0,1), 64 rows), "
          f"error / sum|x||w|:")
    for name in names:
        form, w = load(m.tensors[name], "int4"), torch.from_numpy(read_tensor(m, name))
        xs = torch.randn(64, w.shape[1], generator=g)
        exact, got = xs @ w.T, xs @ form.dequantize().T
        rel = (got - exact).abs() / (xs.abs() @ w.abs().T)  # error per unit of sum |x w|: the bf16 scale
        print(f"  {name:24} max {rel.max().item():.2e}  mean {rel.mean().item():.2e}  "
              f"||err||/||y|| {(got - exact).norm().item() / exact.norm().item():.2e}")


if __name__ == "__main__":
    main()
