"""`kvcli perplexity`: the command (flags, checks, output); the method is kvcli/perplexity.py."""

from __future__ import annotations

import atexit
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kvcli.commands.common import (CacheModeOpt, CthOpt, LayerSplitOpt, PipelineOpt, CtkOpt, CtvOpt, FlashOpt, ModelArg, WeightsOpt, ModelOpt, ThreadsOpt,
                                   KeyBiasOpt, KeyScalesOpt, WindowOpt, cache_spec,
                                   ctx_option, err, log, parse_dtype, parse_flash_attn, parse_threads, parse_weights, read_prompt, resolve_model,
                                   user_errors)
from kvcli.errors import KvcliError
from kvcli.memory import return_freed_memory
from kvcli.kld import KLD_TABLE_HEADER, KldStats, kld_report, kld_terms
from kvcli.logprob_base import Base, BaseWriter, check_base, read_base
from kvcli.perplexity import (PplStats, balanced_n_seq, chunk_logits, first_scored, make_chunks, n_scored, score_chunk,
                              token_nll)


def _write_json(path: Path, data: dict) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror}") from None


def _check_numbers(ctx_size: int, batch_size: int, ubatch_size: int, chunks: int, dtype: str) -> str:
    """The numeric flags and --dtype, checked before the text is read; returns the dtype's name."""
    if ctx_size <= 0:  # no "0 = the model's context" here: a chunk's length is the measurement
        raise KvcliError(f"-c/--ctx-size takes the tokens per chunk, 1 or more, not {ctx_size}")
    if batch_size <= 0:
        raise KvcliError(f"-b/--batch-size takes 1 or more, not {batch_size}")
    if ubatch_size <= 0:
        raise KvcliError(f"-ub/--ubatch-size takes 1 or more, not {ubatch_size}")
    if chunks == 0 or chunks < -1:
        raise KvcliError(f"--chunks takes 1 or more, or -1 (all), not {chunks}")
    return parse_dtype(dtype)


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)


def perplexity_command(
    model_arg: Optional[Path] = ModelArg,
    model: Optional[Path] = ModelOpt,
    file: Path = typer.Option(..., "-f", "--file", help="Text to score, e.g. wikitext-2-raw/wiki.test.raw."),
    ctx_size: int = ctx_option(512, "Tokens per chunk; the second half of each is scored."),
    batch_size: int = typer.Option(2048, "-b", "--batch-size",
                                   help="Tokens per batch: min(b, ub) // c chunks run together as sequences."),
    ubatch_size: int = typer.Option(512, "-ub", "--ubatch-size",
                                    help="Most tokens per forward pass (llama.cpp's physical batch): bounds the "
                                         "logits held at once; a chunk longer than it still runs whole."),
    chunks: int = typer.Option(-1, "--chunks", help="Chunks to score (-1: all)."),
    cache_type_k: Optional[str] = CtkOpt,
    cache_type_v: Optional[str] = CtvOpt,
    cache_mode: str = CacheModeOpt,
    cache_type_h: Optional[str] = CthOpt,
    cache_window: Optional[int] = WindowOpt,
    key_bias: str = KeyBiasOpt,
    key_scales: str = KeyScalesOpt,
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32, f16 or bf16 (activations, and matrices "
                                                     "kept dense)."),
    weights: str = WeightsOpt,
    threads: Optional[int] = ThreadsOpt,
    kl_divergence_base: Optional[Path] = typer.Option(
        None, "--kl-divergence-base", help="Base log-probs file: written by a plain run, read with --kl-divergence."),
    kl_divergence: bool = typer.Option(False, "--kl-divergence", help="Compare this run against --kl-divergence-base."),
    flash_attn: str = FlashOpt,
    sweep_spec: Optional[str] = typer.Option(
        None, "--sweep", help="Cache choices to compare with the base (the cache flags' choice) in one run: "
                              "K/V pairs such as f16/f16,q8_0/q4_0, hidden:TYPE, 'all' (every type as K=V), "
                              "'hidden:all'; @N after an entry sets its --cache-window (q4_hadamard@16)."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the results (sweep rows) as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --sweep: draw mean KLD against cache MiB at 32k tokens (PNG)."),
    pipeline: bool = PipelineOpt,
    layer_split: Optional[str] = LayerSplitOpt,
):
    """Perplexity of a text with llama-perplexity's method; KL divergence against a base; cache sweep."""
    with user_errors():
        # before reading or tokenizing anything
        dtype = _check_numbers(ctx_size, batch_size, ubatch_size, chunks, dtype)
        weights = parse_weights(weights)
        from kvcli.sweep import parse_sweep, plot_sweep, sweep, sweep_table  # imports torch: not for --help

        base_spec = cache_spec(cache_mode, cache_type_k, cache_type_v, cache_type_h, cache_window, key_bias,
                               key_scales)
        flash = parse_flash_attn(flash_attn)
        threads = parse_threads(threads)
        specs = parse_sweep(sweep_spec, cache_window, key_bias=key_bias, key_scales=key_scales) if sweep_spec is not None else None
        if kl_divergence and kl_divergence_base is None:
            raise KvcliError("--kl-divergence reads the base from --kl-divergence-base FILE")
        if specs and kl_divergence_base is not None:
            raise KvcliError("--sweep computes its base in memory; drop --kl-divergence-base / --kl-divergence")
        if plot is not None:
            if not specs:
                raise KvcliError("--plot draws a --sweep; add --sweep")
            try:
                import matplotlib  # noqa: F401  (only to check it is there)
            except ImportError:
                raise KvcliError("--plot needs matplotlib: pip install 'kvcli[plot]'") from None
        base = read_base(kl_divergence_base) if kl_divergence else None
        text = read_prompt(None, file)
        path = resolve_model(model_arg, model)

        from kvcli.gguf_file import open_gguf
        from kvcli.llama import Llama
        from kvcli.pipeline import start as start_pipeline
        from kvcli.tokenizer import Tokenizer

        g = open_gguf(path)
        t0 = time.perf_counter()
        log("perplexity: tokenizing the input ..")
        tok = Tokenizer.from_metadata(g.metadata)
        tokens = tok.encode(text, add_bos=None, parse_special=False)
        log(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):g} ms")
        return_freed_memory()
        bos_id = tok.bos_id if tok.add_bos else None
        if base is not None:
            inputs, targets = check_base(base, tokens, ctx_size, g.config.vocab_size, chunks, bos_id)
        else:
            inputs, targets = make_chunks(tokens, ctx_size, chunks, bos_id)
        n_chunk = inputs.shape[0]
        # sequences batched per forward give each the same bits as one at a time; -ub bounds the logits held, and a
        # forward's tokens as llama.cpp's physical batch does (2048 rows of a 152k vocabulary: 1.2 GB of logits)
        n_seq = balanced_n_seq(min(batch_size, ubatch_size), ctx_size, n_chunk)
        if layer_split is not None and not pipeline:
            raise KvcliError("--layer-split goes with --pipeline")
        if pipeline and specs:
            raise KvcliError("--sweep builds a cache per type in one process; it does not run over --pipeline stages")
        stages, say = (start_pipeline(path, layer_split, base_spec, ctx_size, dtype, weights, "cpu") if pipeline
                       else (None, log))
        llm = Llama(path, ctx_size=ctx_size, dtype=dtype, cache_type_k=base_spec.type_k, cache_type_v=base_spec.type_v,
                    batch_size=min(batch_size, ubatch_size, ctx_size), n_seq=n_seq, threads=threads, flash_attn=flash, log=say,
                    cache_mode=base_spec.mode, cache_type_h=base_spec.type_h, weights=weights,
                    cache_window=base_spec.window, cache_key_bias=base_spec.key_bias,
                    cache_key_scales=base_spec.key_scales, pipeline=stages)
        if stages is not None:
            if not stages[0].first:  # a later stage: its layers for rank 0's forwards, then exit 0
                llm.pipe.serve()
                llm.pipe.close()
                raise typer.Exit(0)
            atexit.register(llm.pipe.stop)  # rank 0, however it ends: the others' loops end with it
        return_freed_memory()
        base_spec = llm.cache_spec  # auto resolved to kv or hidden
        if ctx_size > llm.config.context_length:
            log(f"warning: -c {ctx_size} exceeds the model's training context ({llm.config.context_length})")
        log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={ctx_size}, "
            f"batch_size={batch_size}, ubatch_size={ubatch_size}, n_seq={n_seq}")

        header = dict(model=path.name, n_vocab=llm.config.vocab_size, n_ctx=ctx_size, n_chunk=n_chunk,
                      first=first_scored(ctx_size), n_scored=n_scored(ctx_size), bos_id=bos_id, dtype=dtype,
                      cache_type_k=base_spec.type_k, cache_type_v=base_spec.type_v, cache_mode=base_spec.mode,
                      cache_type_h=base_spec.type_h, cache_window=base_spec.window)
        t_start = time.perf_counter()
        with _progress(err) as progress:
            if specs is not None:
                from kvcli.cache.hidden import store_head_dim

                dims = (llm.config.head_dim, store_head_dim(llm.config.n_embd))  # "all": the types this model fits
                specs = parse_sweep(sweep_spec, cache_window, dims, llm.config.n_layers, key_bias, key_scales)
                n_passes = -(-n_chunk // n_seq) * (1 + sum(s != base_spec for s in specs))
                task = progress.add_task("sweep", total=n_passes)
                rows = sweep(llm, inputs, targets, n_seq, specs, base_spec, lambda: progress.advance(task))
            else:
                task = progress.add_task("perplexity", total=n_chunk)
                writer = None
                if kl_divergence_base is not None and base is None:
                    writer = BaseWriter(kl_divergence_base, header, tokens[: n_chunk * ctx_size])
                result = _run_one(llm, inputs, targets, n_seq, base, writer, progress, task, log)
        seconds = time.perf_counter() - t_start

        if specs:
            from rich.console import Console

            out = Console(highlight=False)
            if not out.is_terminal:  # a file or pipe: do not squeeze the table into 80 columns
                out = Console(highlight=False, width=160)
            out.print(sweep_table(rows, base_spec, ctx_size))
            log(f"perplexity: sweep of {len(rows)} cache types over {n_chunk} chunks took {seconds:.1f} s")
            meta = {k: v for k, v in header.items() if not k.startswith("cache_type") and k != "cache_window"}
            if json_file is not None:
                _write_json(json_file, dict(meta, base_type_k=base_spec.type_k, base_type_v=base_spec.type_v,
                                            base_mode=base_spec.mode, base_type_h=base_spec.type_h,
                                            base_window=base_spec.window, seconds=seconds, rows=rows))
            if plot is not None:
                plot_sweep(rows, plot, f"{path.name}, {Path(file).name}, n_ctx {ctx_size}, {n_chunk} chunks, "
                           f"dtype {dtype}, {weights} weights")
                log(f"perplexity: plot written to {plot}")
        else:
            log(f"perplexity: {n_chunk} chunks took {seconds:.2f} s")
            if json_file is not None:
                _write_json(json_file, dict(header, seconds=seconds, **result))
            if result.get("interrupted"):
                raise typer.Exit(130)


def _nll_and_save(log_probs, targets, writer: "BaseWriter | None"):
    """Scored positions' NLL (r,); their log-probs go to the base file when one is written."""
    if writer is not None:
        writer.add(log_probs, targets)
    return token_nll(log_probs, targets)


def _kld_rows(log_probs, targets, base_rows) -> dict:
    log_base, nll_base = base_rows
    return kld_terms(log_probs, log_base, targets, nll_base)


def _run_one(llm, inputs, targets, n_seq: int, base: Base | None, writer: "BaseWriter | None",
             progress, task, log) -> dict:
    """A plain run (optionally saving the base) or a --kl-divergence run; prints llama.cpp's lines."""
    n_chunk = inputs.shape[0]
    stats, kld = PplStats(), KldStats()
    t_pass = time.perf_counter()
    done = interrupted = False
    try:
        for i, logits in chunk_logits(llm, inputs, n_seq):  # logits: the chunk's blocks, made as they are scored
            if base is None:
                stats.add(score_chunk(logits, lambda pos, lp: _nll_and_save(lp, targets[i, pos], writer)))
            else:
                kld.add(score_chunk(logits, lambda pos, lp: _kld_rows(lp, targets[i, pos], base.rows(i, pos))))
            del logits
            if i == 0:  # llama.cpp's first-pass timing line
                t = time.perf_counter() - t_pass
                log(f"perplexity: {t:.2f} seconds per pass - ETA {t * n_chunk / n_seq / 60:.2f} minutes")
            if base is None:
                # on a terminal the line shows whole at the end, above the bar (which shows the running PPL)
                print(f"[{i + 1}]{stats.ppl:.4f},", end="", flush=not sys.stdout.isatty())
                progress.update(task, advance=1, description=f"[{i + 1}] PPL {stats.ppl:.4f}")
            else:
                if i == 0:
                    print(KLD_TABLE_HEADER, flush=True)
                print(kld.chunk_line(i + 1), flush=True)
                progress.update(task, advance=1, description=f"[{i + 1}] KLD {kld.kld / kld.count:.6f}")
        done = True
    except KeyboardInterrupt:  # Ctrl-C: report the estimate over the chunks scored so far
        interrupted = True
        log("perplexity: interrupted; the estimate below covers the chunks scored so far")
    finally:
        if writer is not None:
            writer.close(complete=done)
    print(flush=True)
    if (stats.count if base is None else kld.count) == 0:
        return dict(interrupted=interrupted)
    if base is not None:
        s = kld.summary()
        for line in kld_report(s):
            print(line)
        return dict(kld={k: v for k, v in s.items() if not isinstance(v, dict)}, interrupted=interrupted)
    ppl, err = stats.estimate()
    if math.isnan(err):
        log("Unexpected negative standard deviation of log(prob)")
        print(f"Final estimate: PPL = {ppl:.4f}")
    else:
        print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
    if writer is not None and not interrupted:
        log(f"perplexity: base log-probs written to {writer.path}")
    return dict(ppl=ppl, ppl_err=err, count=stats.count, interrupted=interrupted)
