"""`kvcli fit` and `kvcli info`: what each cache choice costs per token, and the longest
context each one reaches in a memory budget (the same arithmetic as the run-time check)."""

from __future__ import annotations

from dataclasses import replace

import json
import math
from pathlib import Path

from kvcli.cache import CacheSpec, cache_bytes, resolve_type
from kvcli.cache import layers as layer_types
from kvcli.layer_mix import best_mix
from kvcli.errors import KvcliError
from kvcli.memory import WORKING_BYTES, largest_context

UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
         "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}
MAX_BYTES = 1024**5


def parse_bytes(text: str) -> int:
    """'8GiB', '8G' (binary), '8GB' (decimal), '512MiB', '1000000' -> bytes (at least 1, at most 1 PiB)."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in UNITS or not math.isfinite(value):
        raise KvcliError(f"cannot read a memory size from {text!r} (e.g. 8GiB, 512MiB)")
    n = int(value * UNITS[unit])
    if n < 1:
        raise KvcliError(f"a memory size must be at least 1 byte, not {text!r} (e.g. 8GiB, 512MiB)")
    if n > MAX_BYTES:  # no machine has more; past it the context arithmetic leaves exact integers
        raise KvcliError(f"a memory size of {text!r} is more than 1 PiB; give a real budget (e.g. 8GiB)")
    return n


def choices(window: int | None = None) -> list[CacheSpec]:
    """Every KV type as a K=V pair, the mixed pairs measured worth having (keys cost more than values at
    low bits: benchmarks/README.md), and every hidden-state type; each with `window` (None: its types' default)."""
    from kvcli.cache import STORAGE_TYPES

    types = list(STORAGE_TYPES)
    pairs = [(t, t) for t in types] + [("q8_0", "q4_hadamard"), ("q4_hadamard", "f16"), ("tq4", "tq3"), ("tq3", "tq2")]
    return ([CacheSpec("kv", k, v, window=window) for k, v in pairs]
            + [CacheSpec("hidden", type_h=t, window=window) for t in types])


def load_sweep(path: Path | None) -> dict[CacheSpec, float | None]:
    """Mean KLD per cache choice from `kvcli perplexity --sweep --json` rows (older rows, without
    a mode, are K/V pairs; without a window, they were measured with none); the sweep's base choice
    is KLD 0 against itself."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise KvcliError(f"cannot read sweep results {path}: {e}") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise KvcliError(f"{path} holds no sweep rows: expected the JSON of `kvcli perplexity --sweep --json`")
    out = {}
    for r in rows:
        k, v, h, w = r.get("type_k", r.get("k")), r.get("type_v", r.get("v")), r.get("type_h"), r.get("window", 0)
        if r.get("mode") == "hidden" and h:
            spec = CacheSpec("hidden", type_h=h, window=w)
        elif k and v:
            spec = CacheSpec("kv", k, v, window=w)
        else:
            continue
        kld = r.get("mean_kld", r.get("kld"))
        if kld is not None and not (isinstance(kld, (int, float)) and math.isfinite(kld)):
            raise KvcliError(f"{path}: the KLD of {spec.label} is not a number: {kld!r}")
        out[spec] = kld
    if isinstance(data, dict) and data.get("base_mode") in ("kv", "hidden"):
        base = CacheSpec(data["base_mode"], data.get("base_type_k") or "f16", data.get("base_type_v") or "f16",
                         data.get("base_type_h") or "f16", data.get("base_window", 0))
        out.setdefault(base, 0.0)
    return out


REFERENCE = CacheSpec("kv", "f16", "f16")  # llama.cpp's default cache, and the base a sweep measures against by default


def _types(spec: CacheSpec) -> tuple[str, ...]:
    return (spec.type_h,) if spec.mode == "hidden" else layer_types.all_types(spec.type_k, spec.type_v)


def _rank(row: dict) -> tuple:
    """Sort key, most faithful first: f32 last (twice f16's bytes, no gain over the f16 reference),
    the reference itself, then lowest measured KLD, then unmeasured ones by the bits of their least
    precise part (K, V or hidden state), rotated types first at equal bits, and then their mean
    bits: the closest to f16. Ties keep the table's order."""
    spec = row["spec"]
    weakest = min(resolve_type(t).bits_per_element() for t in _types(spec))
    unrotated = sum(not resolve_type(t).rotated for t in _types(spec))
    return ("f32" in _types(spec), spec != REFERENCE, row["kld"] is None, row["kld"] or 0.0, -weakest, unrotated,
            -row["bits"])


def fit_table(config, weight_bytes: int, mem: int, ctx_wanted: int, sweep: dict[CacheSpec, float | None],
              window: int | None = None) -> tuple[list[dict], dict | None]:
    """One row per choice (with `window`, None: the types' default): bytes per token, largest context,
    KLD where the sweep has it; and the recommendation: the best by `_rank` among the choices reaching
    ctx_wanted (None if none does)."""
    room = mem - weight_bytes - WORKING_BYTES
    rows = [_row(config, ch, room, sweep.get(ch), ch.label) for ch in choices(window)]
    mix = best_mix(config, sweep, room, ctx_wanted)
    if mix is not None:  # the per-layer types a sensitivity sweep (`--sweep layers:K/V`) leads to
        rows.append(_row(config, mix[0], room, mix[1], f"per-layer mix (KLD estimated: {mix[1]:.6f})"))
    reach = [r for r in rows if r["max_ctx"] >= ctx_wanted]
    return rows, (min(reach, key=_rank) if reach else None)


def stages_table(gguf_model, dtype: str, weights: str, device: str, mem: int, ctx_wanted: int,
                 sweep: dict[CacheSpec, float | None], window: int | None, stages: int,
                 layer_split: str | None) -> tuple[list[dict], dict | None, list[tuple]]:
    """fit_table for a model over `stages` pipeline ranks (kvcli/pipeline.py), `mem` each: a choice reaches the
    context its tightest rank reaches, and costs per token what its largest rank's share does. Also (stage,
    weight bytes) per rank."""
    from kvcli.pipeline import Stage, split
    from kvcli.shapes import resident_weight_bytes

    c, tied = gguf_model.config, "output.weight" not in gguf_model.tensors
    held = resident_weight_bytes(c, dtype, not tied, weights, _tensor_types(gguf_model), device)
    ranks, per_rank = [], []
    for r, layers in enumerate(split(c.n_layers, stages, layer_split)):
        stage = Stage(r, stages, layers)
        wb = sum(n for name, n in held.items() if stage.wants(name, tied))
        ranks.append((stage, wb))
        rows, _ = fit_table(replace(c, n_layers=len(layers)), wb, mem, ctx_wanted, sweep, window)
        per_rank.append(rows[: len(choices(window))])  # the per-layer mix is of the whole model's layers
    rows = [dict(row, max_ctx=min(r[i]["max_ctx"] for r in per_rank),
                 bytes_per_token=max(r[i]["bytes_per_token"] for r in per_rank)) for i, row in enumerate(per_rank[0])]
    reach = [r for r in rows if r["max_ctx"] >= ctx_wanted]
    return rows, (min(reach, key=_rank) if reach else None), ranks


def _row(config, ch: CacheSpec, room: int, kld: float | None, label: str) -> dict:
    kv = ch.mode == "kv"
    return {"choice": label, "spec": ch, "mode": ch.mode, "type_k": ch.type_k if kv else None,
            "type_v": ch.type_v if kv else None, "type_h": None if kv else ch.type_h, "window": ch.window,
            "bits": ch.bits_per_element(config.n_layers), "bytes_per_token": cache_bytes(config, ch, 2048) / 2048,
            "max_ctx": largest_context(config, ch, room), "kld": kld}


def basis(best: dict, sweep_name: str | None) -> str:
    """What the recommendation rests on, in words (the rule of `_rank` that decided it)."""
    if best["spec"] == REFERENCE:
        return "f16/f16 is the reference precision and it fits (f32 would take twice the bytes for no gain)"
    if best["kld"] is not None:
        return (f"the lowest measured KLD among the choices that fit: {best['kld']:.6f} in {sweep_name} "
                f"(unmeasured choices rank after measured ones)")
    rule = ("bits per element, the closest to f16: the most bits in the least precise part (K, V or hidden "
            "state), rotated types first at equal bits (they lose less: benchmarks/README.md), then the most bits "
            "on average")
    if sweep_name is None:
        return rule + " (no --sweep: `kvcli perplexity --sweep --json` results rank by measured KLD)"
    return rule + f" (none of the choices that fit is measured in {sweep_name})"


def weight_bytes(gguf_model, dtype: str, weights: str = "native", device: str = "cpu") -> int:
    """The resident bytes of a GGUF model's weights (kvcli.shapes.weight_bytes, per tensor from its type)."""
    from kvcli.shapes import weight_bytes as of_config

    return of_config(gguf_model.config, dtype, "output.weight" in gguf_model.tensors, weights,
                     _tensor_types(gguf_model), device)


def _tensor_types(gguf_model) -> dict[str, str]:
    return {n: t.tensor_type.name for n, t in gguf_model.tensors.items()}


def resident_table(gguf_model, dtype: str, weights: str = "native", device: str = "cpu") -> list[tuple]:
    """Per GGUF tensor type among the decoder's tensors: (type, resident form, tensors, file bytes, resident bytes)."""
    from kvcli.shapes import resident_weight_bytes
    from kvcli.weights import tensor_form

    held = resident_weight_bytes(gguf_model.config, dtype, "output.weight" in gguf_model.tensors, weights,
                                 _tensor_types(gguf_model), device)
    rows: dict[tuple[str, str], list[int]] = {}
    for name, n in held.items():
        t = gguf_model.tensors[name]
        form = "f32" if len(t.shape) == 1 else tensor_form(gguf_model.tensors, name, weights, dtype, device)
        r = rows.setdefault((t.tensor_type.name, form), [0, 0, 0])
        r[0], r[1], r[2] = r[0] + 1, r[1] + int(t.n_bytes), r[2] + n
    return [(t, form, *r) for (t, form), r in sorted(rows.items())]
