"""`kvcli fit`: the largest context each cache choice reaches in a memory budget (the plan is kvcli/fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvcli.commands.common import (WINDOW_HELP, ModelArg, ModelOpt, WeightsOpt, ctx_option, parse_device, parse_dtype,
                                   parse_weights, resolve_model, rich_table, user_errors)
from kvcli.errors import KvcliError
from kvcli.memory import GIB, MIB, WORKING_BYTES


def fit_command(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
                mem: str = typer.Option(..., "--mem", help="Memory budget, e.g. 8GiB, 512MiB."),
                ctx: int = ctx_option(0, "Context wanted (0: the model's trained context)."),
                sweep: Optional[Path] = typer.Option(None, "--sweep", help="JSON from `kvcli perplexity --sweep --json`."),
                device: str = typer.Option("cpu", "--device", help="cpu or cuda (the budget is that device's memory)."),
                dtype: str = typer.Option("f16", "--dtype", help="Compute dtype of the weights kept dense."),
                weights: str = WeightsOpt,
                cache_window: Optional[int] = typer.Option(None, "-cw", "--cache-window", min=0,
                                                           help=WINDOW_HELP + " Applied to every choice."),
                stages: int = typer.Option(1, "--stages", min=1, help="Plan for --pipeline over this many ranks, "
                                           "--mem each: each rank's layers, weights and cache."),
                layer_split: Optional[str] = typer.Option(None, "--layer-split", help="With --stages: layers per "
                                                          "rank, e.g. 10,14 (default: even).")):
    """The largest context each cache choice reaches in a memory budget, and the one to use."""
    with user_errors():
        from kvcli.cache import CacheSpec
        from kvcli.fit import basis, fit_table, load_sweep, parse_bytes, stages_table, weight_bytes
        from kvcli.gguf_file import open_gguf

        device, dtype, weights = parse_device(device), parse_dtype(dtype), parse_weights(weights)
        if ctx < 0:
            raise KvcliError(f"--ctx takes a token count, or 0 for the model's trained context; not {ctx}")
        budget = parse_bytes(mem)
        measured = load_sweep(sweep)
        g = open_gguf(resolve_model(model_arg, model))
        wanted = ctx or g.config.context_length
        if layer_split is not None and stages == 1:
            raise KvcliError("--layer-split goes with --stages N (N > 1)")
        out = Console(highlight=False)
        if stages == 1:
            wb = weight_bytes(g, dtype, weights, device)
            rows, best = fit_table(g.config, wb, budget, wanted, measured, cache_window)
            out.print(f"{Path(g.path).name} on {device}: budget {budget / GIB:.2f} GiB, weights {wb / GIB:.2f} GiB "
                      f"(--weights {weights}, --dtype {dtype}), working buffers {WORKING_BYTES // MIB} MiB", markup=False, soft_wrap=True)
        else:
            rows, best, ranks = stages_table(g, dtype, weights, device, budget, wanted, measured, cache_window, stages,
                                             layer_split)
            wb = max(n for _, n in ranks)
            out.print(f"{Path(g.path).name} over {stages} ranks on {device}: budget {budget / GIB:.2f} GiB a rank, "
                      f"working buffers {WORKING_BYTES // MIB} MiB a rank (--weights {weights}, --dtype {dtype})",
                      markup=False, soft_wrap=True)
            for stage, n in ranks:
                out.print(f"  {stage.describe()}: weights {n / GIB:.3f} GiB", markup=False, soft_wrap=True)
        table = [[r["choice"], str(r["window"]), f"{r['bits']:.2f}", f"{r['bytes_per_token']:,.0f}", f"{r['max_ctx']:,}",
                  "-" if r["kld"] is None else f"{r['kld']:.6f}"] for r in rows]
        out.print(rich_table("largest context per cache choice", ["cache", "window", "bits", "bytes/token", "max ctx",
                                                                   "KLD"], table))
        if best is None:
            if wb + WORKING_BYTES >= budget:
                raise KvcliError(f"the weights ({wb / GIB:.2f} GiB) and working buffers ({WORKING_BYTES // MIB} MiB) "
                                 f"alone fill {mem}; no context fits")
            raise KvcliError(f"no cache choice reaches a {wanted:,}-token context in {mem}; the best reaches "
                             f"{max(r['max_ctx'] for r in rows):,} tokens")
        if stages > 1:
            flags_stages = f" --pipeline{f' --layer-split {layer_split}' if layer_split else ''}"
        else:
            flags_stages = ""
        flags = (f"--cache-mode hidden -cth {best['type_h']}" if best["mode"] == "hidden"
                 else f"-ctk {best['type_k']} -ctv {best['type_v']}")
        s = best["spec"]
        if s != CacheSpec(s.mode, s.type_k, s.type_v, s.type_h):  # not the types' default window
            flags += f" --cache-window {s.window}"
        out.print(f"recommended for {wanted:,} tokens: {best['choice']} ({flags} -c {wanted}{flags_stages})", markup=False,
                  soft_wrap=True)
        out.print(f"  based on: {basis(best, sweep and sweep.name)}", markup=False, soft_wrap=True)
