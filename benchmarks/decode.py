"""Prefill and decode tokens/s of kvcli and of transformers' `generate`, same GGUF, same run.

    python benchmarks/decode.py [-m MODEL] [--prompt-tokens 256] [--n 128] [--ctx 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcli.llama import Llama
from kvcli.pull import pull_default


def bench_kvcli(path, dtype, prompt, n, ctx, reps):
    llm = Llama(path, ctx_size=ctx, dtype=dtype)
    llm.logits(prompt[:16])  # warm-up
    pp, tg = [], []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        logits = llm.eval(prompt)
        t1 = time.perf_counter()
        token = int(logits.argmax())
        for _ in range(n):
            token = int(llm.eval([token]).argmax())
        t2 = time.perf_counter()
        pp.append(len(prompt) / (t1 - t0))
        tg.append(n / (t2 - t1))
    return pp, tg


def bench_transformers(path, prompt, n, reps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    pp, tg = [], []
    with torch.no_grad():
        model(ids[:, :16])
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False, pad_token_id=0)
            t2 = time.perf_counter()
            pp.append(len(prompt) / (t1 - t0))
            tg.append(n / ((t2 - t1) - (t1 - t0)))  # generate = one prefill + n decode steps
    return pp, tg


def fmt(xs):
    return f"{statistics.mean(xs):8.1f} ± {statistics.pstdev(xs):5.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from pathlib import Path

    path = Path(a.model) if a.model else pull_default()
    llm = Llama(path, ctx_size=16, dtype="f32")
    text = "The history of the city begins in the early middle ages, when a small settlement grew " * 40
    prompt = llm.tokenize(text)[: a.prompt_tokens]
    del llm
    print(f"model {path.name}, prompt {len(prompt)} tokens, {a.n} generated, ctx {a.ctx}, "
          f"{torch.get_num_threads()} threads, {a.reps} reps (tokens/s, mean ± std)")
    print(f"| {'engine':32s} | {'prefill t/s':>16s} | {'decode t/s':>16s} |")
    print(f"|{'-' * 34}|{'-' * 18}|{'-' * 18}|")
    rows = {}
    for dtype in ("f16", "f32"):
        pp, tg = bench_kvcli(path, dtype, prompt, a.n, a.ctx, a.reps)
        rows[f"kvcli --dtype {dtype} (f16 cache)"] = (pp, tg)
        print(f"| {'kvcli --dtype ' + dtype + ' (f16 cache)':32s} | {fmt(pp)} | {fmt(tg)} |", flush=True)
    pp, tg = bench_transformers(path, prompt, a.n, a.reps)
    print(f"| {'transformers f32 generate':32s} | {fmt(pp)} | {fmt(tg)} |")
    best = statistics.mean(rows["kvcli --dtype f16 (f16 cache)"][1])
    print(f"kvcli f16 decode / transformers decode = {best / statistics.mean(tg):.2f}x")


if __name__ == "__main__":
    main()
