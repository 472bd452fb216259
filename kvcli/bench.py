"""`kvcli bench`: llama-bench's pp/tg speeds for every combination of cache choices.

Semantics follow llama-bench: for each combination, the cache is first filled to the depth
(not timed), then `ppN` times one N-token prompt and `tgN` times N one-token decode steps;
one warm-up run of the same test at the same depth (a tg one of at most 32 steps), so that no
repetition pays a kernel's first load (numba's, at most once per process), then mean +/- std
tokens/s over the repetitions. params_m counts the model's parameters (the GGUF's tensor elements,
llama-bench's model_n_params), model_mib its weights' resident bytes.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass

from kvcli.cache import CacheSpec, resolve_type
from kvcli.cache.spec import scaled_keys, treats_keys
from kvcli.memory import MIB


@dataclass
class BenchRow:
    model: str
    params_m: float
    backend: str
    threads: int
    cache_mode: str
    type_k: str
    type_v: str
    type_h: str
    fa: str
    test: str
    depth: int
    tokens_per_s: float
    std: float
    cache_mib: float
    synthetic: bool = False
    window: int = 0  # the cache's recent window (kvcli/cache/window.py); its bytes are in cache_mib
    model_mib: float = 0.0  # the weights' resident bytes (kvcli.model.Transformer.weight_bytes)
    keys_less_bias: bool = False  # keys stored less their turning mean in some layer (kvcli/cache/key_bias.py)
    keys_scaled: bool = False  # keys scaled for the queries in some layer (kvcli/cache/key_scale.py)


def split_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _canonical(names: list[str]) -> list[str]:
    # Rows name what ran: an alias (q4, Q8) becomes its type's name (q4_hadamard, q8_0), and a
    # type given twice under two names runs once.
    return list(dict.fromkeys(resolve_type(n).name for n in names))


def combinations(modes, ctks, ctvs, cths, fas) -> list[tuple[str, str, str, str, str]]:
    """(mode, type_k, type_v, type_h, fa): K/V types only vary in kv mode, the hidden type only in
    hidden mode, so no combination is run twice under another name."""
    ctks, ctvs, cths = _canonical(ctks), _canonical(ctvs), _canonical(cths)
    out = []
    for mode, fa in itertools.product(modes, fas):
        if mode == "hidden":
            out += [(mode, "-", "-", h, fa) for h in cths]
        else:
            out += [(mode, k, v, "-", fa) for k, v in itertools.product(ctks, ctvs)]
    return out


def _tokens(n: int, vocab: int, salt: int = 0) -> list[int]:
    # Fixed pseudo-random ids (llama-bench uses random tokens): speed does not depend on them.
    return [(i * 7919 + salt * 104729) % (vocab - 10) + 5 for i in range(n)]


def _time_case(llm, test: str, n: int, depth: int) -> float:
    vocab = llm.config.vocab_size
    llm.reset()
    if depth:
        llm.eval(_tokens(depth, vocab, 1))
    if test == "pp":
        t0 = time.perf_counter()
        llm.eval(_tokens(n, vocab, 2))
        return n / (time.perf_counter() - t0)
    token = 7
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(llm.eval([token]).argmax())
    return n / (time.perf_counter() - t0)


def run_bench(make_llm, model_name: str, tests: list[tuple[str, int]], depths: list[int], combos, reps: int,
              threads: int, backend: str, synthetic: bool = False, progress=None,
              windows: list[int | None] = (None,)) -> list[BenchRow]:
    """tests: ("pp", n) and ("tg", n) as llama-bench's -p and -n values (0 skips);
    make_llm(ctx, mode, type_k, type_v, type_h, flash_attn[, window=w]) -> Llama, one per combination and
    window: windows are --cache-window's values (None: the types' default, window= not passed); one
    that a combination would keep the same (dense types keep none) runs once."""
    rows = []
    ctx = max(depths) + max(n for _, n in tests) + 1
    for mode, tk, tv, th, fa in combos:
        types = [t if t != "-" else "f16" for t in (tk, tv, th)]
        done = set()
        for w in windows:
            if CacheSpec(mode, *types, w).window in done:
                continue
            llm = make_llm(ctx, mode, *types, fa != "off", **({} if w is None else {"window": w}))
            done.add(llm.cache.window)
            params, weight_mib = n_params(llm) / 1e6, llm.model.weight_bytes() / MIB
            keys_less_bias = bool(treats_keys(llm.config, llm.cache_spec))
            keys_scaled = bool(scaled_keys(llm.model, llm.cache_spec))
            for depth in depths:
                for test, n in tests:
                    if n <= 0:
                        continue
                    _time_case(llm, test, n if test == "pp" else min(n, 32), depth)  # warm-up, as the test runs
                    speeds = [_time_case(llm, test, n, depth) for _ in range(reps)]
                    label = f"{test}{n}" + (f" @ d{depth}" if depth else "")
                    rows.append(BenchRow(model_name, params, backend, threads, mode, tk, tv, th, fa, label, depth,
                                         statistics.mean(speeds), statistics.pstdev(speeds),
                                         llm.cache.nbytes() / MIB, synthetic, llm.cache.window, weight_mib,
                                         keys_less_bias, keys_scaled))
                    if progress:
                        progress(rows[-1])
            del llm
    return rows


def n_params(llm) -> int:
    """The model's parameters: its GGUF tensors' elements (a --shape model's: the shapes it stands for)."""
    import math

    if llm.gguf is not None:
        return sum(t.n_elements for t in llm.gguf.tensors.values())
    from kvcli.gguf_file import expected_shapes

    return sum(math.prod(s) for s in expected_shapes(llm.config).values())


COLUMNS = ["model", "backend", "threads", "cache_mode", "type_k", "type_v", "type_h", "window", "fa", "test", "t/s",
           "cache MiB"]


def _cells(r: BenchRow) -> list[str]:
    name = r.model + (" (synthetic)" if r.synthetic else "")
    return [name, r.backend, str(r.threads), r.cache_mode, r.type_k, r.type_v, r.type_h, str(r.window), r.fa, r.test,
            f"{r.tokens_per_s:.2f} ± {r.std:.2f}", f"{r.cache_mib:.2f}"]


def to_markdown(rows: list[BenchRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if c in ("t/s", "cache MiB", "threads", "window")
                                                             else "---"
                                                             for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


def to_csv(rows: list[BenchRow]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(asdict(rows[0]).keys()) if rows else ["model"])
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()
