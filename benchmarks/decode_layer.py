"""Decode t/s with the compiled decode layer (kvcli/decode_layer.py) and op by op, alternated in one process.

    python benchmarks/decode_layer.py [-m MODEL] [-t 1] [--types f16,q8_0,tq4] [-n 64] [-d 0] [--rounds 3]

For each cache type: a fresh cache, `-d` random tokens prefilled, one decode step untimed, then n single-token
steps through the model (`Transformer.forward`, as `kvcli bench`'s tg), rounds alternating the two paths. The
op-by-op path is the compiled layer's plan refused (decode_layer.plan -> None), so both run the same kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcli.decode_layer as decode_layer
from kvcli.llama import Llama
from kvcli.pull import pull_default


def tokens_per_s(llm: Llama, compiled: bool, n: int, depth: int) -> float:
    decode_layer.plan = PLAN if compiled else (lambda block, cache=None: None)
    for b in llm.model.blocks:
        b._plan_for, b._halves = None, None
    cache = llm.new_cache(llm.cache_spec)
    model, pos = llm.model, 0
    if depth:
        model(torch.randint(100, 1000, (1, depth)), cache, 0, last_only=True)
        pos = depth
    token = torch.tensor([[200]])
    model(token, cache, pos)
    pos += 1
    t0 = time.perf_counter()
    for _ in range(n):
        model(token, cache, pos)
        pos += 1
    return n / (time.perf_counter() - t0)


PLAN = decode_layer.plan  # the real one, put back for each compiled round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--types", default="f16,q8_0,tq4")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-d", "--depth", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = args.model or str(pull_default())
    print(f"{path.split('/')[-1]}, -t {args.threads}, tg{args.n} at depth {args.depth}, {args.rounds} rounds alternated")
    print("| cache | compiled layer t/s | op by op t/s | ratio (medians) |\n| --- | ---: | ---: | ---: |")
    for t in args.types.split(","):
        llm = Llama(path, ctx_size=args.depth + args.n + 16, threads=args.threads, cache_type_k=t, cache_type_v=t)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for compiled in (True, False):
                runs[compiled].append(tokens_per_s(llm, compiled, args.n, args.depth))
        a, b = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"| {t} | {', '.join(f'{x:.1f}' for x in runs[True])} | {', '.join(f'{x:.1f}' for x in runs[False])} "
              f"| {a / b:.2f}x |")


if __name__ == "__main__":
    main()
