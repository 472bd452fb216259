"""Key recipes against outlier channels (issue 41, point 1): mean KLD of each (recipe, cache type) against f16.

    python benchmarks/key_recipes.py -m models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --chunks 5 \
        --types q8_0,q4_hadamard,tq4,tq3,tq3/tq2 --recipes plain,bias,prerope,smooth,l0q8 [--json out.json]

Each row is what `kvcli perplexity -f FILE -c N --chunks M --sweep TYPE` prints for the plain type (the
rows come from kvcli.sweep.sweep itself, against the f16 cache, same chunks, same scoring); a recipe row
runs the same type with its K store wrapped by kvcli/cache/key_recipe.py (KeyRecipeStore: transform on
write, inverse on read, PyTorch reference attention). Recipes (K only; V keeps the type):
  plain       the type as kvcli has it (no wrapper)
  none        the wrapper doing nothing (a check: equals plain up to rounding)
  bias        the K bias subtracted after RoPE (k - R(p) b), added back exactly on read
  mean        a constant per layer/head/channel subtracted (the calibration pass's mean key), added back
  prerope     keys quantized before RoPE, RoPE applied on read (KVQuant)
  prerope+bias  the same with b subtracted before quantizing
  smooth      channel j divided by s_j = (max|k_j| / geomean)^0.5 from the calibration pass (SmoothQuant;
              folded into the query by a kernel); smooth1: exponent 1 (per-channel scale)
  qscale      channel j divided by s_j = (a_j / b_j)^(1/4), a the keys' variance before RoPE and b the queries' mean
              square (their K head's group, after RoPE), both averaged over each RoPE pair, from the calibration
              pass: what kvcli/cache/key_scale.py takes from the weights (--key-scales), from real activations
  outN        the N channels of largest calibrated RMS per layer/head kept in f16 (dense-and-sparse); the RMS
              of the keys as steps 1-2 leave them (mean+outN: of the centred keys)
  l0q8, l0f16, l01q8  keys of layer 0 (layers 0-1) at q8_0 / f16, the rest at the type (a mixed cache)
  a+b         steps combined, e.g. bias+smooth, mean+out2, prerope+bias+smooth
The calibration pass runs the model (f16 cache) over one chunk far from the scored ones (--calib-chunk) and
records each layer's keys as the recipe's steps before `smooth`/`outN` leave them.

bits/el is the mean over K and V of the nominal bits per element (the sweep's column), K's counted over
layers (a mixed cache: each layer at its type) plus 16 bits per f16 outlier channel per position; per-layer
constants (bias, s, means, channel lists: D floats per layer and head) are not. Figures go to
benchmarks/README.md. Run with -t 2 on the shared CPU; --chunks 5 to screen, 20 for a table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from kvcli.cache import CacheSpec, resolve_type
from kvcli.cache.base import Store
from kvcli.cache.key_recipe import KeyRecipe, KeyRecipeStore
from kvcli.cache.key_scale import pair_mean
from kvcli.llama import Llama
from kvcli.perplexity import balanced_n_seq, make_chunks
from kvcli.sweep import sweep

N_SINK = 4  # calibration statistics skip the first positions (attention sinks: BOS keys are outliers)


@dataclass(frozen=True)
class RecipeSpec(CacheSpec):
    """A sweep entry: a cache choice and the recipe around its keys (its own key in sweep's dicts)."""

    recipe: str = "plain"


class Recorder(KeyRecipeStore):
    """Records, per layer, each channel's mean, mean square and max |x| of what `forward` hands the inner store."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        L, H, D = self.n_layers, self.n_heads, self.head_dim
        self.s1, self.s2, self.amax, self.n = torch.zeros(L, H, D), torch.zeros(L, H, D), torch.zeros(L, H, D), [0] * L

    def store(self, layer, x, pos):
        y, _ = self.forward(layer, x, pos)
        y = y[:, max(0, N_SINK - pos):].flatten(0, 1)  # (n, H, D)
        self.s1[layer] += y.sum(0)
        self.s2[layer] += (y * y).sum(0)
        self.amax[layer] = torch.maximum(self.amax[layer], y.abs().amax(0))
        self.n[layer] += y.shape[0]
        self.inner.store(layer, x, pos)


def calibrate(llm, ids, recipe: KeyRecipe) -> dict:
    """Key statistics (L, H, D) of one calibration chunk ids (1, n_ctx) in the space `recipe` stores, and the
    queries' mean square per K head's group (qms, (L, Hkv, D), past the sinks)."""
    c = llm.config
    cache = llm.new_cache(CacheSpec("kv", "f16", "f16", window=0, key_scales="off"))
    rec = Recorder(cache.k, recipe, llm.model.rot, c.rope_neox)
    cache.k = rec
    q2, nq = torch.zeros(c.n_layers, c.n_kv_heads, c.head_dim), [0] * c.n_layers
    attend = type(cache).attention

    def recording(self, layer, q, k, v, x, pos):  # q (B, T, H, D) as the block hands it over
        y = q[:, N_SINK:].float()
        q2[layer] += y.square().reshape(-1, c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim).sum((0, 2))
        nq[layer] += y.shape[0] * y.shape[1] * (c.n_heads // c.n_kv_heads)
        return attend(self, layer, q, k, v, x, pos)

    cache.attention = recording.__get__(cache)
    llm.logits(ids.expand(llm.n_seq, -1), cache=cache)
    n = torch.tensor(rec.n, dtype=torch.float32).view(-1, 1, 1)
    mean = rec.s1 / n
    return dict(mean=mean, rms=(rec.s2 / n).sqrt(), amax=rec.amax,
                qms=q2 / torch.tensor(nq, dtype=torch.float32).view(-1, 1, 1))


def build_recipe(name: str, llm, calib_ids, cache_stats: dict) -> tuple[KeyRecipe, tuple[str, tuple[int, ...]] | None]:
    """A recipe name (the docstring's list) -> (KeyRecipe, (alt type, alt layers) or None)."""
    c = llm.config
    H, D = c.n_heads, c.head_dim
    steps = name.split("+")
    alt = None
    mixed = {"l0q8": ("q8_0", (0,)), "l0f16": ("f16", (0,)), "l01q8": ("q8_0", (0, 1))}
    for s in steps:
        if s in mixed:
            alt = mixed[s]
    r = KeyRecipe(pre_rope="prerope" in steps)
    if "bias" in steps:
        if not c.qkv_bias:
            raise SystemExit(f"recipe {name}: this model has no K bias")
        r.bias = torch.stack([b.bqkv[H * D : (H + c.n_kv_heads) * D].view(c.n_kv_heads, D)
                              for b in llm.model.blocks]).float()  # (L, Hkv, D)
    smooth = [s for s in steps if s.startswith("smooth")]
    outs = [s for s in steps if s.startswith("out")]
    if "qscale" in steps:
        if "pre" not in cache_stats:  # keys before RoPE (their variance), queries after it
            cache_stats["pre"] = calibrate(llm, calib_ids, KeyRecipe(pre_rope=True))
        st = cache_stats["pre"]
        a = pair_mean(st["rms"].square() - st["mean"].square(), c.rope_neox).clamp_min(1e-30)
        b = pair_mean(st["qms"], c.rope_neox).clamp_min(1e-30)
        s = (a / b).pow(0.25)
        r.scale = s / s.log().mean(-1, keepdim=True).exp()
    if "mean" in steps or smooth or outs:
        key = (r.pre_rope, r.bias is not None)
        if key not in cache_stats:  # the statistics of keys as steps 1-2 leave them
            cache_stats[key] = calibrate(llm, calib_ids, KeyRecipe(pre_rope=r.pre_rope, bias=r.bias))
        st = cache_stats[key]
        if "mean" in steps:  # a constant in the stored space, exact once added back; smooth/outN: of centred keys
            r.offset = st["mean"]
            if key + (True,) not in cache_stats:
                cache_stats[key + (True,)] = calibrate(llm, calib_ids, KeyRecipe(r.pre_rope, r.bias, r.offset))
            st = cache_stats[key + (True,)]
        if outs:
            n = int(outs[0][3:])
            r.outliers = st["rms"].topk(n, dim=-1).indices  # (L, Hkv, n)
        if smooth:
            alpha = 1.0 if smooth[0] == "smooth1" else 0.5
            a = st["amax"].clamp_min(1e-6)
            if r.outliers is not None:  # kept channels do not set the scale
                a = a.scatter(-1, r.outliers, 1.0)
            s = a.pow(alpha)
            r.scale = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per head
    return r, alt


class Recipes:
    """What kvcli.sweep.sweep asks of a Llama, with new_cache building recipe caches (kept, for their bytes)."""

    def __init__(self, llm, calib_ids, key_scales: str = "off"):
        self.llm, self.config, self.calib_ids, self.key_scales = llm, llm.config, calib_ids, key_scales
        self.stats: dict = {}
        self.built: dict = {}

    def logits(self, ids, cache=None):
        return self.llm.logits(ids, cache=cache)

    def logit_batches(self, *args, **kwargs):
        return self.llm.logit_batches(*args, **kwargs)

    def new_cache(self, spec: RecipeSpec):
        llm, c = self.llm, self.config
        cache = llm.new_cache(CacheSpec("kv", spec.type_k, spec.type_v, window=spec.window, key_scales=self.key_scales))
        if spec.recipe != "plain":
            recipe, alt = build_recipe(spec.recipe, llm, self.calib_ids, self.stats)
            alt_store = None
            if alt:
                alt_store = resolve_type(alt[0])(c.n_layers, llm.n_seq, c.n_kv_heads, llm.n_ctx, c.head_dim, keys=True)
                llm.attention.bind(alt_store)
            cache.k = KeyRecipeStore(cache.k, recipe, llm.model.rot, c.rope_neox, alt_store, alt[1] if alt else ())
        self.built[spec] = cache
        return cache


def k_bits(spec: RecipeSpec, cache, L: int, D: int) -> float:
    """Nominal bits per K element: each layer at its type, plus f16 outlier channels."""
    k = cache.k
    if not isinstance(k, KeyRecipeStore):
        return resolve_type(spec.type_k).bits_per_element()
    n_alt = len(k.alt_layers)
    inner = resolve_type(spec.type_k).bits_per_element()
    alt = type(k.alt).bits_per_element() if k.alt is not None else 0.0
    return ((L - n_alt) * (inner + 16 * k.side.shape[-1] / D) + n_alt * alt) / L


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("-f", "--file", default="/work/shared/data/wikitext-2-raw/wiki.test.raw")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--chunks", type=int, default=5)
    p.add_argument("--calib-chunk", type=int, default=100, help="the chunk of the file the calibration pass reads")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--types", default="q8_0,q4_hadamard,tq4,tq3,tq3/tq2",
                   help="K/V cache choices as --sweep takes them (one name: K = V; @N: a window)")
    p.add_argument("--recipes", default="plain,bias,prerope,prerope+bias,smooth,l0q8")
    p.add_argument("--key-scales", default="off", help="the cache's own --key-scales under every row (off: keys as "
                   "the recipe leaves them)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from kvcli.sweep import parse_sweep

    llm = Llama(a.model, ctx_size=a.ctx_size, dtype="f32", threads=a.threads, n_seq=1, batch_size=a.ctx_size)
    text = open(a.file, encoding="utf-8").read()
    tok = llm.tokenizer
    tokens = tok.encode(text, add_bos=None, parse_special=False)
    bos = tok.bos_id if tok.add_bos else None
    inputs, targets = make_chunks(tokens, a.ctx_size, a.chunks, bos)
    calib_in, _ = make_chunks(tokens, a.ctx_size, a.calib_chunk + 1, bos)
    calib = calib_in[a.calib_chunk : a.calib_chunk + 1]
    n_seq = balanced_n_seq(a.ctx_size, a.ctx_size, inputs.shape[0])
    base = CacheSpec("kv", "f16", "f16")
    specs = [RecipeSpec("kv", s.type_k, s.type_v, window=s.window, recipe=r)
             for s in parse_sweep(a.types) for r in a.recipes.split(",")]
    proxy = Recipes(llm, calib, a.key_scales)
    t0 = time.perf_counter()
    rows = sweep(proxy, inputs, targets, n_seq, specs, base)
    c = llm.config
    out = []
    for spec, row in zip([base, *specs], rows):
        cache = proxy.built.get(spec)
        kb = 16.0 if cache is None else k_bits(spec, cache, c.n_layers, c.head_dim)
        vb = resolve_type(spec.type_v).bits_per_element()
        row.update(recipe=getattr(spec, "recipe", "base"), bits_per_element=(kb + vb) / 2, k_bits=kb)
        out.append(row)
        print(f"{row['cache']:>16s} {row['recipe']:>20s} bits {row['bits_per_element']:5.2f} (K {kb:5.2f})  "
              f"KLD {row['mean_kld']:.5f} ± {row['mean_kld_err']:.5f}  same top {row['same_top_pct']:5.2f}%  "
              f"dPPL {row['delta_ppl_pct']:+7.2f}%  {row['seconds']:.0f}s", flush=True)
    print(f"{a.model}: {inputs.shape[0]} chunks of {a.ctx_size}, {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, n_ctx=a.ctx_size, chunks=inputs.shape[0], rows=out), f, indent=1)


if __name__ == "__main__":
    main()
