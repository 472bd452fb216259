"""`kvcli bench`: llama-bench's table of pp/tg speed and cache MiB per cache choice (the runs are kvcli/bench.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from kvcli.commands.common import (WINDOW_HELP, DtypeOpt, ModelArg, ModelOpt, ThreadsOpt, WeightsOpt, log, parse_device,
                                   parse_dtype, parse_flash_attn, parse_threads, parse_weights, resolve_model,
                                   user_errors)
from kvcli.errors import KvcliError


def bench_command(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
                  n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="Prompt lengths (comma list)."),
                  n_gen: str = typer.Option("128", "-n", "--n-gen", help="Generation lengths (comma list)."),
                  depth: str = typer.Option("0", "-d", "--n-depth", help="Cache depths (comma list)."),
                  cache_type_k: str = typer.Option("f16", "-ctk", "--cache-type-k", help="K types (comma list)."),
                  cache_type_v: str = typer.Option("f16", "-ctv", "--cache-type-v", help="V types (comma list)."),
                  cache_mode: str = typer.Option("kv", "--cache-mode", help="kv, hidden (comma list)."),
                  cache_type_h: str = typer.Option("f16", "-cth", "--cache-type-h", help="Hidden-state types (comma list)."),
                  cache_window: Optional[str] = typer.Option(None, "-cw", "--cache-window",
                                                             help="Recent windows (comma list). " + WINDOW_HELP),
                  key_bias: str = typer.Option("auto", "--key-bias", help="auto, on or off, for every row: keys "
                                               "stored less their turning mean (kvcli/cache/key_bias.py)."),
                  key_scales: str = typer.Option("auto", "--key-scales", help="auto, on or off, for every row: keys "
                                                 "scaled for the queries (kvcli/cache/key_scale.py)."),
                  flash_attn: str = typer.Option("on", "-fa", "--flash-attn", help="on, off (comma list)."),
                  repetitions: int = typer.Option(3, "-r", "--repetitions"),
                  output: str = typer.Option("md", "-o", "--output", help="md, json or csv."),
                  threads: Optional[int] = ThreadsOpt,
                  dtype: str = DtypeOpt,
                  weights: str = WeightsOpt,
                  device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
                  shape: Optional[str] = typer.Option(None, "--shape", help="A published configuration with random weights "
                                                      "(llama2-7b, llama2-13b, llama3-8b, mistral-7b, smollm2-135m): speed "
                                                      "and memory only, labelled synthetic.")):
    """llama-bench: pp/tg tokens/s and cache MiB for every combination of the listed cache choices."""
    with user_errors():
        from kvcli.bench import combinations, run_bench, split_list, to_csv, to_json, to_markdown
        from kvcli.cache import resolve_type

        device, dtype, weights = parse_device(device), parse_dtype(dtype), parse_weights(weights)
        if output not in ("md", "json", "csv"):
            raise KvcliError(f"-o takes md, json or csv, not {output!r}")
        if repetitions < 1:
            raise KvcliError(f"-r/--repetitions takes 1 or more, not {repetitions}")
        threads = parse_threads(threads)
        try:
            ps, ns, ds = ([int(v) for v in split_list(x)] for x in (n_prompt, n_gen, depth))
        except ValueError:
            raise KvcliError("-p, -n and -d take comma-separated integers") from None
        for flag, values in (("-p/--n-prompt", ps), ("-n/--n-gen", ns), ("-d/--n-depth", ds)):
            if any(v < 0 for v in values):
                raise KvcliError(f"{flag} takes token counts of 0 or more, not {min(values)}")
        windows = [None] if cache_window is None else split_list(cache_window)
        if not all(w is None or w.isdigit() for w in windows) or not windows:
            raise KvcliError(f"-cw/--cache-window takes comma-separated counts of 0 or more, not {cache_window!r}")
        windows = [None if w is None else int(w) for w in windows]
        modes = split_list(cache_mode)
        fas = ["on" if parse_flash_attn(f) else "off" for f in split_list(flash_attn)]  # llama.cpp's spellings too
        ctks, ctvs, cths = split_list(cache_type_k), split_list(cache_type_v), split_list(cache_type_h)
        for t in ctks + ctvs + cths:
            resolve_type(t)
        for m in modes:
            if m not in ("kv", "hidden"):
                raise KvcliError(f"--cache-mode takes kv or hidden in bench, not {m!r}")
        if shape is not None:
            from kvcli.shapes import shape_config

            shape_config(shape)  # a clear error for an unknown name
        path = resolve_model(model_arg, model) if shape is None else None

        import torch

        from kvcli.llama import Llama

        if threads:
            torch.set_num_threads(threads)

        def make(ctx, mode, tk, tv, th, fa, window=None):
            return Llama(path, ctx_size=ctx, dtype=dtype, cache_type_k=tk, cache_type_v=tv, cache_mode=mode,
                         cache_type_h=th, flash_attn=fa, device=device, shape=shape, weights=weights,
                         cache_window=window, cache_key_bias=key_bias, cache_key_scales=key_scales)

        combos = combinations(modes, ctks, ctvs, cths, fas)
        backend = "CUDA" if device == "cuda" else "CPU"
        name = path.name if shape is None else shape
        tests = [("pp", p) for p in ps if p > 0] + [("tg", n) for n in ns if n > 0]
        if not tests:
            raise KvcliError("nothing to measure: give -p and/or -n above 0")
        rows = run_bench(make, name, tests, ds, combos, repetitions, torch.get_num_threads(), backend,
                         synthetic=shape is not None, windows=windows,
                         progress=lambda r: log(f"{r.cache_mode} {r.type_k}/{r.type_v}/{r.type_h} fa {r.fa} "
                                                f"{r.test}: {r.tokens_per_s:.2f} t/s"
                                                + (f" (window {r.window})" if r.window else "")))
        text = {"md": to_markdown, "json": to_json, "csv": to_csv}[output](rows)
        sys.stdout.write(text + "\n")
