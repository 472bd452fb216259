"""Decode tokens/s at a given cache depth for several cache types, measured in one run.

    python benchmarks/cache_decode.py [-m MODEL] [--depth 4096] [--n 32] [--reps 3] [--types f16,q8_0,q4_0,q4_hadamard]
                                      [--fill-once]

A type may name its recent window as --sweep does (q4_hadamard@0,q4_hadamard@16); without @, the
type's default window.

Types are interleaved within each repetition so machine noise hits them alike; the best
repetition per type is reported beside the mean, and the speed relative to f16 is the median
of the per-repetition ratios (each taken from runs seconds apart, so the least noisy figure).
--fill-once fills each cache to the depth once and lets the repetitions continue from there
(each n steps deeper, alike for every type): many short repetitions without a prefill each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvcli.llama import Llama
from kvcli.pull import pull_default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_hadamard")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fill-once", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    path = Path(a.model) if a.model else pull_default()
    types = a.types.split(",")
    ctx = a.depth + a.n * (a.reps if a.fill_once else 1) + 1
    llms = {}
    for t in types:
        name, at, window = t.partition("@")
        llms[t] = Llama(path, ctx_size=ctx, dtype=a.dtype, cache_type_k=name, cache_type_v=name,
                        cache_window=int(window) if at else None)
    prompt = [(i * 7919) % 40000 + 100 for i in range(a.depth)]  # arbitrary ids: the speed does not care
    speeds: dict[str, list[float]] = {t: [] for t in types}
    if a.fill_once:
        for llm in llms.values():
            llm.eval(prompt)  # fill the cache to the depth once (not timed)
    for _ in range(a.reps):
        for t, llm in llms.items():
            if not a.fill_once:
                llm.reset()
                llm.eval(prompt)  # fill the cache to the depth (not timed)
            token = 200
            t0 = time.perf_counter()
            for _ in range(a.n):
                token = int(llm.eval([token]).argmax())
            speeds[t].append(a.n / (time.perf_counter() - t0))
    f16 = speeds.get("f16")
    print(f"{path.name}, depth {a.depth}, {a.n} decode steps, --dtype {a.dtype}, {torch.get_num_threads()} threads")
    print(f"| {'cache K/V':12s} | {'MiB':>8s} | {'best t/s':>9s} | {'mean t/s':>9s} | {'vs f16':>6s} |")
    print(f"|{'-' * 14}|{'-' * 10}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for t, xs in speeds.items():
        ratio = f"{statistics.median(x / y for x, y in zip(xs, f16)):6.2f}" if f16 else "     -"
        mib = llms[t].cache.nbytes() / 2**20
        print(f"| {t:12s} | {mib:8.2f} | {max(xs):9.1f} | {statistics.mean(xs):9.1f} | {ratio} |")


if __name__ == "__main__":
    main()
