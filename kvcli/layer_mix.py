"""`kvcli fit --mem`'s per-layer mix: from a per-layer sensitivity sweep (`kvcli perplexity --sweep layers:K/V`, one
row per layer with that layer alone at K/V and the rest at f16), the per-layer types with the least summed KLD
whose cache fits a memory budget at the wanted context.

Layers' KLDs are taken as adding up (each row measures one layer's loss alone): the estimate the recommendation
prints as such. The choice is a multiple-choice knapsack (for each layer one of f16 or a measured pair; bytes at
the wanted context within the room), solved exactly by dynamic programming over the bytes in BUCKETS steps.
"""

from __future__ import annotations

from kvcli.cache import CacheSpec, KVCache, cache_bytes
from kvcli.cache.base import window_for
from kvcli.cache import layers as layer_types

BUCKETS = 4000  # byte steps of the budget: rounding each layer's bytes up, the mix never overshoots the room


def sensitivity(measured: dict[CacheSpec, float | None], n_layers: int) -> tuple[dict[int, dict], int]:
    """{layer: {(K type, V type): KLD}} from the sweep's single-layer rows (every other layer f16), and their window."""
    out: dict[int, dict] = {}
    window = 0
    for spec, kld in measured.items():
        if spec.mode != "kv" or not spec.mixed or kld is None:
            continue
        k, v = layer_types.per_layer(spec.type_k, n_layers), layer_types.per_layer(spec.type_v, n_layers)
        odd = [i for i in range(n_layers) if (k[i], v[i]) != ("f16", "f16")]
        if len(odd) == 1:
            out.setdefault(odd[0], {})[(k[odd[0]], v[odd[0]])] = kld
            window = max(window, spec.window)
    return out, window


def best_mix(config, measured: dict[CacheSpec, float | None], room: int, n_ctx: int) -> tuple[CacheSpec, float] | None:
    """The per-layer spec with the least summed KLD whose cache at n_ctx fits `room` bytes, and that sum; None
    where the sweep has no complete per-layer sensitivity (every layer measured) or nothing fits."""
    n = config.n_layers
    sens, window = sensitivity(measured, n)
    if len(sens) < n or room <= 0:
        return None

    def layer_bytes(tk: str, tv: str) -> int:  # one layer's cache at n_ctx, its window included
        return KVCache.bytes_needed(1, 1, config.kv_dim, n_ctx, tk, tv, window_for((tk, tv), window))

    step = room / BUCKETS
    options = []  # per layer: [(buckets, kld, (K type, V type))]
    for i in range(n):
        pairs = {("f16", "f16"): 0.0, **sens[i]}
        options.append([(-(-layer_bytes(*p) // step), kld, p) for p, kld in pairs.items()])
    # best[b] = (least KLD, choices) over the layers so far using b buckets
    best = {0: (0.0, ())}
    for opts in options:
        nxt: dict[int, tuple] = {}
        for used, (kld, picks) in best.items():
            for cost, k, pair in opts:
                b = used + int(cost)
                if b <= BUCKETS and (b not in nxt or kld + k < nxt[b][0]):
                    nxt[b] = (kld + k, picks + (pair,))
        best = _pareto(nxt)
        if not best:
            return None
    kld, picks = min(best.values(), key=lambda t: t[0])
    spell = lambda side: "+".join(f"{p[side]}={i}" for i, p in enumerate(picks))  # noqa: E731
    spec = CacheSpec("kv", spell(0), spell(1), window=window)
    if cache_bytes(config, spec, n_ctx) > room:  # the bucket rounding errs on the safe side; checked exactly
        return None
    return spec, kld


def _pareto(states: dict[int, tuple]) -> dict[int, tuple]:
    """Keep a state only where no cheaper one has less KLD (the table stays small)."""
    out, least = {}, float("inf")
    for b in sorted(states):
        if states[b][0] < least:
            out[b], least = states[b], states[b][0]
    return out
