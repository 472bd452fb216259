"""The hidden-state cache's figures (issue 6), on the MHA form of a GQA GGUF (default: SmolLM2 as 9/9 heads).

1. Mean KL divergence against the f16 KV cache, llama-perplexity style: c=512, the first
   --chunks chunks of wiki.test.raw (BOS at each chunk's start), the second half of each scored.
2. Cache MiB at 80k context for kv f16, kv q4_hadamard and hidden f16 / q8_0 / q4_hadamard.
3. Decode tokens/s at several depths for kv f16 and hidden f16, alternated in one run (noisy
   machines); the cache is filled with random contents, which do not change the work.

    python benchmarks/hidden_cache.py [--model X.gguf] [--chunks 20] [--depths 512,2048,8192] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.convert.mha import gqa_to_mha  # noqa: E402
from kvcli.cache import CacheSpec, KVCache, make_cache  # noqa: E402
from kvcli.cache.hidden import HiddenCache  # noqa: E402
from kvcli.llama import Llama  # noqa: E402
from kvcli.perplexity import make_chunks, scored_log_probs, token_nll  # noqa: E402
from kvcli.attention import Attention  # noqa: E402

MIB = 1024 * 1024
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
HIDDEN_TYPES = ("f16", "q8_0", "q4_hadamard")


def kld(llm: Llama, n_ctx: int, chunks: int, device: str) -> None:
    text = WIKI.read_text(encoding="utf-8")[: 60 * n_ctx * chunks]  # a prefix: enough tokens, fast to tokenize
    tok = llm.tokenizer
    tokens = tok.encode(text, add_bos=None, parse_special=False)
    inputs, targets = make_chunks(tokens, n_ctx, chunks, tok.bos_id if tok.add_bos else None)
    c = llm.config
    caches = {"kv f16": make_cache(c, CacheSpec(), n_ctx, device=device, attention=Attention())}
    caches |= {f"hidden {t}": make_cache(c, CacheSpec("hidden", type_h=t), n_ctx, device=device, model=llm.model, attention=Attention())
               for t in HIDDEN_TYPES}
    sums = {name: [0.0, 0.0, 0.0] for name in caches}  # KLD sum, NLL sum, count
    t0 = time.perf_counter()
    for i in range(inputs.shape[0]):
        logp = {}
        for name, cache in caches.items():
            llm.cache = cache
            logp[name] = scored_log_probs(llm.logits(inputs[i]), n_ctx)  # (n_scored, V)
            sums[name][1] += float(token_nll(logp[name], targets[i].to(logp[name].device)).sum())
            sums[name][2] += logp[name].shape[0]
        base = logp["kv f16"]
        for name in caches:
            sums[name][0] += float((base.exp() * (base - logp[name])).sum(-1).clamp_min(0).sum())
        print(f"  chunk {i + 1}/{inputs.shape[0]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(f"\nmean KLD vs kv f16, c={n_ctx}, {inputs.shape[0]} chunks, {int(sums['kv f16'][2])} scored tokens:")
    for name, (k, nll, n) in sums.items():
        print(f"  {name:20s} KLD {k / n:.6f}   PPL {torch.tensor(nll / n).exp():.4f}")


def sizes(llm: Llama, n_ctx: int) -> None:
    c = llm.config
    print(f"\ncache MiB at {n_ctx} context ({c.n_layers} layers, n_embd {c.n_embd}, kv_dim {c.kv_dim}):")
    for t in ("f16", "q4_hadamard"):
        print(f"  kv {t:13s} {KVCache.bytes_needed(c.n_layers, 1, c.kv_dim, n_ctx, t, t) / MIB:9.1f}")
    for t in HIDDEN_TYPES:
        print(f"  hidden {t:9s} {HiddenCache.bytes_needed(c.n_layers, 1, c.n_embd, n_ctx, t) / MIB:9.1f}")


def decode_speed(llm: Llama, depths: list[int], reps: int, device: str) -> None:
    c, n_ctx = llm.config, llm.n_ctx
    g = torch.Generator().manual_seed(0)
    caches = {"kv f16": make_cache(c, CacheSpec(), n_ctx, device=device, attention=Attention()),
              "hidden f16": make_cache(c, CacheSpec("hidden"), n_ctx, device=device, model=llm.model, attention=Attention())}
    fill = max(depths)
    for layer in range(c.n_layers):  # random contents at positions 0..fill-1
        for s in (caches["kv f16"].k, caches["kv f16"].v):
            s.store(layer, torch.randn(1, fill, c.n_kv_heads, c.head_dim, generator=g).to(device), 0)
        h = caches["hidden f16"].h
        h.store(layer, torch.randn(1, fill, h.n_heads, h.head_dim, generator=g).to(device), 0)
    print(f"\ndecode tokens/s ({device}, {torch.get_num_threads()} threads, median of {reps}, alternating):")
    for depth in depths:
        times = {name: [] for name in caches}
        for _ in range(reps + 1):  # the first round warms up
            for name, cache in caches.items():
                llm.cache, llm.n_past = cache, depth
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.eval([1])
                if device != "cpu":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
        line = "   ".join(f"{name} {1 / statistics.median(ts[1:]):8.2f}" for name, ts in times.items())
        print(f"  depth {depth:6d}: {line}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--depths", default="512,2048,8192")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip", default="", help="comma list of parts to skip: kld, speed")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    with tempfile.TemporaryDirectory() as d:
        mha = gqa_to_mha(a.model, Path(d) / "mha.gguf")
        llm = Llama(mha, ctx_size=a.ctx, device=a.device, batch_size=a.ctx)
        c = llm.config
        print(f"model: {a.model.name} rewritten as MHA: {c.n_heads}/{c.n_kv_heads} heads, {c.n_layers} layers")
        if "kld" not in skip:
            kld(llm, a.ctx, a.chunks, a.device)
        sizes(llm, 80 * 1024)
        if "speed" not in skip:
            depths = [int(x) for x in a.depths.split(",")]
            llm = Llama(mha, ctx_size=max(depths) + 8, device=a.device)
            decode_speed(llm, depths, a.reps, a.device)


if __name__ == "__main__":
    main()
