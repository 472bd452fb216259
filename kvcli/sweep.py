"""`kvcli perplexity --sweep`: every listed cache choice against the base choice in one run, one
model in memory. Each cache is built by `Llama.new_cache`, the constructor a run uses, so any
choice a run accepts (hidden-state caches included) can be swept; each row is what
--kl-divergence against a saved base of the base choice reports. Results as a table, JSON, a plot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from kvcli.cache import STORAGE_TYPES, CacheSpec, cache_bytes
from kvcli.cache.spec import scaled_keys
from kvcli.errors import KvcliError
from kvcli.kld import KldStats, kld_terms
from kvcli.logprob_base import from_records, record_dtype, to_records
from kvcli.memory import MIB
from kvcli.perplexity import PplStats, chunk_logits, n_scored, score_chunk, token_nll


def parse_sweep(spec: str, window: int | None = None, head_dims: tuple[int, int] | None = None,
                n_layers: int | None = None, key_bias: str = "auto", key_scales: str = "auto") -> list[CacheSpec]:
    """"f16/f16,q8_0/q4_0,q8_0,hidden:q4_0,q4_hadamard@16" -> cache choices: K/V pairs (a lone name is
    used for both), hidden-state types after "hidden:", and "all" / "hidden:all" for every registered
    storage type, so new cache types join the sweep. "@N" sets an entry's recent window; without it,
    `window` (--cache-window; None: the types' default). head_dims, the model's (K/V head size, hidden
    store head size) once known: "all" leaves out the types whose blocks do not divide them. K/V types may
    differ by layer (`q8_0=0-1+tq3`, kvcli/cache/layers.py); "layers:K/V" is the per-layer sensitivity sweep:
    one choice per layer with that layer alone at K/V and every other at f16 (n_layers, the model's, once
    known; before, the entry is only checked). key_bias, key_scales: --key-bias, --key-scales, for every K/V entry."""
    specs: list[CacheSpec] = []
    per_layer = False  # a layers: entry (no choices until the model's layer count is known)
    for item in spec.split(","):
        item = item.strip().lower()
        if not item:
            continue
        item, at, n = item.partition("@")
        w = window
        if at:
            if not n.strip().isdigit():
                raise KvcliError(f"--sweep entry {item + at + n!r}: @ takes a window of 0 or more positions, "
                                 f"e.g. q4_hadamard@16")
            w = int(n)
        mode, _, types = item.rpartition(":")
        if mode not in ("", "hidden", "layers"):
            raise KvcliError(f"--sweep entry {item!r}: write K/V types (q8_0/q4_0), hidden:TYPE or layers:K/V")
        names = [types]
        if mode == "layers":
            k, _, v = types.partition("/")
            CacheSpec("kv", k.strip(), (v or k).strip())  # checks the types before the model loads
            names = [f"{k.strip()}={i}+f16/{(v or k).strip()}={i}+f16" for i in range(n_layers or 0)]
            per_layer = True
        if types.strip() == "all":
            d = None if head_dims is None else head_dims[mode == "hidden"]
            names = [n for n, cls in STORAGE_TYPES.items() if d is None or d % cls.block_size == 0]
        for name in names:
            if mode == "hidden":
                found = CacheSpec("hidden", type_h=name.strip(), window=w)
            else:
                k, _, v = name.partition("/")
                found = CacheSpec("kv", k.strip(), (v or k).strip(), window=w, key_bias=key_bias,
                                  key_scales=key_scales)
            if found not in specs:
                specs.append(found)
    if not specs and not per_layer:
        raise KvcliError("--sweep needs cache choices, e.g. f16/f16,q8_0/q8_0,hidden:q8_0")
    return specs


def row_label(spec: CacheSpec) -> str:
    """The sweep's name for a choice: K/V types (one name where equal) or hidden:TYPE, and @N for a
    window (as --sweep takes it)."""
    if spec.mode == "hidden":
        name = f"hidden:{spec.type_h}"
    else:
        name = spec.type_k if spec.type_k == spec.type_v else f"{spec.type_k}/{spec.type_v}"
    return (name + (f"@{spec.window}" if spec.window else "") + ("" if spec.key_bias == "auto" else f" kb={spec.key_bias}")
            + ("" if spec.key_scales == "auto" else f" ks={spec.key_scales}"))


def sweep(llm, inputs, targets, n_seq: int, specs: list[CacheSpec], base_spec: CacheSpec,
          tick: Callable[[], None] = lambda: None) -> list[dict]:
    """One row per cache choice against the base choice's run, chunk batch by chunk batch (no base file);
    each chunk scored a block of positions at a time (`score_chunk`).

    Every cache comes from `llm.new_cache`, as a run builds its own. The base log-probs go through
    the base file's 16-bit rounding, so each row equals what --kl-divergence against a saved base
    reports; the base choice's own row is the base itself (KLD 0), first where the sweep does not
    list it (as `all` does), so the table always shows what the others are measured against."""
    import numpy as np
    import torch

    if base_spec not in specs:
        specs = [base_spec, *specs]
    n_ctx = inputs.shape[1]
    records = record_dtype(llm.config.vocab_size)
    caches = {s: llm.new_cache(s) for s in specs if s != base_spec}  # the base runs in llm's own cache
    base_stats, seconds = PplStats(), dict.fromkeys([base_spec, *specs], 0.0)
    klds = {s: KldStats() for s in specs}

    def base_rows(pos, lp, tgt, rec):  # the base's NLL; its log-probs kept in the base file's 16-bit form
        nll = token_nll(lp, tgt)
        rec[pos] = to_records(lp, nll, records)
        return kld_terms(lp, lp, tgt) if base_spec in klds else dict(nll=nll)  # the base's own row: KLD 0

    for i in range(0, inputs.shape[0], n_seq):
        batch, tgt = inputs[i : i + n_seq], targets[i : i + n_seq]
        t0 = time.perf_counter()
        base_rec, base_nll = [], []  # per chunk: (n_scored,) records, exact NLL (n_scored,) f64
        for j, logits in chunk_logits(llm, batch, n_seq):
            base_rec.append(np.empty(n_scored(n_ctx), dtype=records))
            t = score_chunk(logits, lambda pos, lp: base_rows(pos, lp, tgt[j, pos], base_rec[j]))
            base_nll.append(t["nll"])
            if base_spec in klds:
                klds[base_spec].add(t)
            del logits
        base_stats.add(torch.stack(base_nll))  # (B, S), summed as one tensor
        seconds[base_spec] += time.perf_counter() - t0
        tick()
        for spec, cache in caches.items():
            t0 = time.perf_counter()
            for j, logits in chunk_logits(llm, batch, n_seq, cache=cache):
                klds[spec].add(score_chunk(logits, lambda pos, lp: kld_terms(
                    lp, from_records(base_rec[j][pos])[0], tgt[j, pos], base_nll[j][pos])))
                del logits
            seconds[spec] += time.perf_counter() - t0
            tick()
        del base_rec, base_nll
    base_ppl = base_stats.ppl
    rows = []
    for spec in specs:
        s = klds[spec].summary()
        kv = spec.mode == "kv"
        rows.append(dict(
            cache=row_label(spec), mode=spec.mode, type_k=spec.type_k if kv else None,
            type_v=spec.type_v if kv else None, type_h=None if kv else spec.type_h, window=spec.window,
            keys_scaled=len(scaled_keys(getattr(llm, "model", None), spec)),  # layers (kvcli/cache/key_scale.py)
            bits_per_element=spec.bits_per_element(llm.config.n_layers),
            cache_mib=cache_bytes(llm.config, spec, n_ctx) / MIB, cache_mib_32k=cache_bytes(llm.config, spec, 32768) / MIB,
            ppl=s["ppl"], ppl_err=s["ppl_err"], delta_ppl_pct=100 * (s["ppl"] / base_ppl - 1),
            mean_kld=s["kld"], mean_kld_err=s["kld_err"], kld_99=s["kld_pct"][0.99], same_top_pct=100 * s["same_top"],
            rms_p_diff_pct=100 * s["rms_p_diff"], seconds=seconds[spec],
        ))
    return rows


def sweep_table(rows: list[dict], base_spec: CacheSpec, n_ctx: int):
    from rich.table import Table

    base = (f"{base_spec.type_k}/{base_spec.type_v}" + (f"@{base_spec.window}" if base_spec.window else "")
            if base_spec.mode == "kv" else row_label(base_spec))
    t = Table(title=f"KV cache types against {base} (n_ctx {n_ctx})")
    for name in ("K", "V", "window", "bits/el", f"MiB @{n_ctx}", "MiB @32k", "PPL", "ΔPPL %", "mean KLD", "same top %",
                 "s"):
        t.add_column(name, justify="left" if name in ("K", "V") else "right")
    for r in rows:
        k, v = (r["type_k"], r["type_v"]) if r["mode"] == "kv" else ("hidden", r["type_h"])
        t.add_row(k, v, str(r["window"]), f"{r['bits_per_element']:.2f}", f"{r['cache_mib']:.2f}",
                  f"{r['cache_mib_32k']:.1f}", f"{r['ppl']:.4f} ± {r['ppl_err']:.4f}", f"{r['delta_ppl_pct']:+.3f}",
                  f"{r['mean_kld']:.6f}".replace("-0.000000", "0.000000"),  # rounding noise below 1e-6
                  f"{r['same_top_pct']:.2f}", f"{r['seconds']:.1f}")
    return t


def plot_sweep(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        # cache MiB, not bits per element: a hidden-state cache stores other elements than K and V
        ax.scatter(r["cache_mib_32k"], r["mean_kld"], color="tab:blue")
        ax.annotate(r["cache"], (r["cache_mib_32k"], r["mean_kld"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("cache MiB at 32k tokens")
    ax.set_ylabel("mean KL divergence vs base (nats)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
