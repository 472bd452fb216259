"""`kvcli info`: a model's metadata, its resident weights, and the cache bytes per token of every choice."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvcli.commands.common import (WINDOW_HELP, ModelArg, ModelOpt, WeightsOpt, parse_dtype, parse_weights,
                                   resolve_model, rich_table, user_errors)
from kvcli.memory import MIB


def info_command(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
                 dtype: str = typer.Option("f16", "--dtype", help="Compute dtype the weight bytes are given for: f16, bf16 "
                                                                  "or f32."),
                 weights: str = WeightsOpt,
                 cache_window: Optional[int] = typer.Option(None, "-cw", "--cache-window", min=0,
                                                            help=WINDOW_HELP + " Applied to every choice.")):
    """Model metadata, weight types and bytes, and the cache bytes per token of every cache choice."""
    with user_errors():
        dtype, weights = parse_dtype(dtype), parse_weights(weights)
        from kvcli.fit import cache_bytes, choices, resident_table, weight_bytes
        from kvcli.gguf_file import open_gguf

        g = open_gguf(resolve_model(model_arg, model))
        c = g.config
        out = Console(highlight=False)
        out.print(f"model: {Path(g.path).name}  ({g.metadata.get('general.name', '?')})")
        out.print(f"arch {c.arch}, {c.n_layers} layers, n_embd {c.n_embd}, n_ff {c.n_ff}, heads {c.n_heads}/"
                  f"{c.n_kv_heads} (head dim {c.head_dim}), vocab {c.vocab_size}, trained context {c.context_length}, "
                  f"rope base {c.rope_base:g}, rms eps {c.rms_eps:g}")
        types = ", ".join(f"{n} x {t}" for t, n in sorted(g.weight_types().items()))
        out.print(f"weights: {types}; {g.weight_bytes() / MIB:.2f} MiB in the file, "
                  f"{weight_bytes(g, dtype, weights) / MIB:.2f} MiB in memory (--weights {weights}, --dtype {dtype})")
        rows = [[t, form, str(n), f"{file / MIB:.2f}", f"{held / MIB:.2f}"]
                for t, form, n, file, held in resident_table(g, dtype, weights)]
        out.print(rich_table("resident weights per tensor type", ["type", "form", "tensors", "file MiB", "memory MiB"],
                              rows))
        # bytes per token at 2048 tokens: the window's fixed bytes spread over them
        rows = [[ch.label, str(ch.window), f"{ch.bits_per_element(c.n_layers):.2f}", f"{cache_bytes(c, ch, 2048) / 2048:,.0f}",
                 f"{cache_bytes(c, ch, 32768) / MIB:,.1f}"] for ch in choices(cache_window)]
        out.print(rich_table("cache bytes per token", ["cache", "window", "bits", "bytes/token", "MiB @ 32k"], rows))
        _print_kernels(out, c.head_dim)


def _print_kernels(out, head_dim: int) -> None:
    """Which kernel of the table (kvcli/kernel_table.py) runs each cache type and weight form on this machine, and
    why the others do not."""
    from kvcli import attention, kernel_table, weights

    caps = os.environ.get("KVCLI_ISA")
    out.print(f"kernels on this machine (CPU levels: {', '.join(kernel_table.isa_levels())}"
              f"{f'; capped by KVCLI_ISA={caps}' if caps else ''}):")
    for line in attention.kernel_lines(head_dim) + weights.kernel_lines():
        out.print(line, soft_wrap=True)
