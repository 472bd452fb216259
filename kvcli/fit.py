"""`kvcli fit` and `kvcli info`: what each cache choice costs per token, and the longest
context each one reaches in a memory budget (the same arithmetic as the run-time check)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvcli.cache import CacheSpec, cache_bytes
from kvcli.errors import KvcliError
from kvcli.memory import WORKING_BYTES, largest_context

UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
         "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'8GiB', '8G' (binary), '8GB' (decimal), '512MiB', '1000000' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise KvcliError(f"cannot read a memory size from {text!r} (e.g. 8GiB, 512MiB)") from None
    if unit not in UNITS or value <= 0:
        raise KvcliError(f"cannot read a memory size from {text!r} (e.g. 8GiB, 512MiB)")
    return int(value * UNITS[unit])


def choices() -> list[CacheSpec]:
    """Every KV type as a K=V pair, llama.cpp's mixed favourites, and every hidden-state type."""
    from kvcli.cache import STORAGE_TYPES

    types = list(STORAGE_TYPES)
    kv = [CacheSpec("kv", t, t) for t in types] + [CacheSpec("kv", "q8_0", "q4_hadamard"),
                                                   CacheSpec("kv", "q4_hadamard", "f16")]
    return kv + [CacheSpec("hidden", type_h=t) for t in types]


def load_sweep(path: Path | None) -> dict[CacheSpec, float | None]:
    """Mean KLD per cache choice from `kvcli perplexity --sweep --json` rows (older rows, without
    a mode, are K/V pairs)."""
    if path is None:
        return {}
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise KvcliError(f"cannot read sweep results {path}: {e}") from None
    rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
    out = {}
    for r in rows:
        k, v, h = r.get("type_k", r.get("k")), r.get("type_v", r.get("v")), r.get("type_h")
        if r.get("mode") == "hidden" and h:
            out[CacheSpec("hidden", type_h=h)] = r.get("mean_kld", r.get("kld"))
        elif k and v:
            out[CacheSpec("kv", k, v)] = r.get("mean_kld", r.get("kld"))
    return out


def fit_table(config, weight_bytes: int, mem: int, ctx_wanted: int, sweep: dict[CacheSpec, float | None]
              ) -> tuple[list[dict], dict | None]:
    """One row per choice: bytes per token, largest context, KLD where the sweep has it; and the
    recommendation: the most faithful choice reaching ctx_wanted (lowest KLD, else most bits)."""
    room = mem - weight_bytes - WORKING_BYTES
    rows = []
    for ch in choices():
        n = largest_context(config, ch, room)
        kld = sweep.get(ch)
        rows.append({"choice": ch.label, "mode": ch.mode, "type_k": ch.type_k if ch.mode == "kv" else None,
                     "type_v": ch.type_v if ch.mode == "kv" else None, "type_h": ch.type_h if ch.mode == "hidden" else None,
                     "bits": ch.bits_per_element(), "bytes_per_token": cache_bytes(config, ch, 2048) / 2048,
                     "max_ctx": n, "kld": kld})
    reach = [r for r in rows if r["max_ctx"] >= ctx_wanted]
    if not reach:
        return rows, None
    best = min(reach, key=lambda r: (r["kld"] if r["kld"] is not None else math.inf, -r["bits"]))
    return rows, best



def weight_bytes(gguf_model, dtype: str) -> int:
    from kvcli.shapes import weight_bytes as of_config

    return of_config(gguf_model.config, dtype, "output.weight" in gguf_model.tensors)
