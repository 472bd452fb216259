"""`kvcli serve`: the command (flags, checks); the server is kvcli/serve (imported once the flags pass,
so `kvcli --help` imports neither torch nor the web stack)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from kvcli.commands.common import (CacheModeOpt, CthOpt, CtkOpt, CtvOpt, DtypeOpt, FlashOpt, KeyBiasOpt, KeyScalesOpt, LayerSplitOpt,
                                   ModelArg, ModelOpt, PipelineOpt, ThreadsOpt, WeightsOpt, WindowOpt, cache_spec,
                                   ctx_option, log, parse_device, parse_dtype, parse_flash_attn, parse_threads,
                                   parse_weights, resolve_model, user_errors, warn_known_loss)
from kvcli.errors import KvcliError
from kvcli.memory import MIB


def serve_command(
    model_arg: Optional[Path] = ModelArg,
    model: Optional[Path] = ModelOpt,
    # llama-server's own default is -c 0 -np auto (4 slots over one unified pool); kvcli's slots each own a
    # cache of c / np cells, so it keeps the earlier defaults: one slot of 4096 tokens
    ctx_size: int = ctx_option(4096, "Total context in tokens, split evenly over the -np slots "
                                     "(0: the model's trained context)."),
    parallel: int = typer.Option(1, "-np", "--parallel", help="Slots: requests decoded together, each with "
                                                              "c / np tokens of context."),
    batch_size: int = typer.Option(512, "-b", "--batch-size", help="Prompt tokens per forward pass (a request's "
                                                                   "prompt is prefilled a chunk per step)."),
    queue: Optional[int] = typer.Option(None, "--queue", help="Requests that may wait for a slot when all are "
                                                              "busy (default: 4 x np); past it: 503."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer KEY` "
                                                                  "(/, /health, /v1/health, /models and /v1/models "
                                                                  "stay open)."),
    cache_ram: Optional[int] = typer.Option(None, "-cram", "--cache-ram", help="MiB of host RAM for finished "
                                            "conversations' caches, in their packed form: a request on any slot starts "
                                            "from the longest prefix they share with it (llama-server's; -1: no limit, "
                                            "0: off; default 8192, off with --pipeline)."),
    slot_save_path: Optional[Path] = typer.Option(None, "--slot-save-path", help="Folder for slot files: POST "
                                                  "/slots/{id}?action=save|restore with {\"filename\": NAME} keeps a "
                                                  "slot's cache there (made if absent)."),
    cache_type_k: Optional[str] = CtkOpt,
    cache_type_v: Optional[str] = CtvOpt,
    cache_mode: str = CacheModeOpt,
    cache_type_h: Optional[str] = CthOpt,
    cache_window: Optional[int] = WindowOpt,
    key_bias: str = KeyBiasOpt,
    key_scales: str = KeyScalesOpt,
    flash_attn: str = FlashOpt,
    threads: Optional[int] = ThreadsOpt,
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the model and its caches run."),
    pipeline: bool = PipelineOpt,
    layer_split: Optional[str] = LayerSplitOpt,
):
    """An OpenAI-compatible server (llama-server): /v1/chat/completions, /v1/completions, /v1/models, /health,
    /tokenize, /detokenize, /metrics, /props, /slots (with --slot-save-path: POST /slots/{id}?action=save|restore|
    erase) and a chat page at /. The -np slots decode together, one batched step at a time; SIGINT/SIGTERM stop it."""
    with user_errors():
        spec = cache_spec(cache_mode, cache_type_k, cache_type_v, cache_type_h, cache_window, key_bias,
                          key_scales)  # fail before loading
        fa = parse_flash_attn(flash_attn)
        device, dtype, weights = parse_device(device), parse_dtype(dtype), parse_weights(weights)
        if ctx_size < 0:
            raise KvcliError(f"-c/--ctx-size takes a token count (0: the model's trained context), not {ctx_size}")
        if parallel < 1:
            raise KvcliError(f"-np/--parallel takes 1 or more slots, not {parallel}")
        if batch_size < 1:
            raise KvcliError(f"-b/--batch-size takes 1 or more, not {batch_size}")
        if queue is not None and queue < 0:
            raise KvcliError(f"--queue takes 0 or more, not {queue}")
        if pipeline and cache_ram not in (None, 0):
            raise KvcliError("--cache-ram with --pipeline: each rank holds only its layers' cache (a RAM copy of a "
                             "conversation is not yet kept over the stages); leave it out or give 0")
        if pipeline and slot_save_path is not None:
            raise KvcliError("--slot-save-path with --pipeline: each rank holds only its layers' cache (slot files are "
                             "not yet saved over the stages)")
        if layer_split is not None and not pipeline:
            raise KvcliError("--layer-split goes with --pipeline")
        cache_ram = (0 if pipeline else 8192) if cache_ram is None else cache_ram
        if cache_ram < -1:
            raise KvcliError(f"--cache-ram takes MiB, -1 (no limit) or 0 (off), not {cache_ram}")
        if not 0 <= port <= 65535:
            raise KvcliError(f"--port takes 0..65535, not {port}")
        if api_key is not None and not api_key:
            raise KvcliError("--api-key takes a non-empty key")
        if ctx_size and ctx_size < parallel * 2:
            raise KvcliError(f"-c {ctx_size} over -np {parallel} slots leaves under 2 tokens per slot")
        threads = parse_threads(threads)
        path = resolve_model(model_arg, model)
        if slot_save_path is not None:
            try:
                slot_save_path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise KvcliError(f"--slot-save-path {slot_save_path}: {e.strerror}") from None
            if not os.access(slot_save_path, os.W_OK):
                raise KvcliError(f"--slot-save-path {slot_save_path}: not writable")

        from kvcli.gguf_file import open_gguf

        total = ctx_size or open_gguf(path).config.context_length
        if total < parallel * 2:
            raise KvcliError(f"-c {total} over -np {parallel} slots leaves under 2 tokens per slot")
        stages, say = None, log
        if pipeline:  # every rank joins before rank 0 listens: a mismatched rank is refused first
            from kvcli.pipeline import start as start_pipeline

            stages, say = start_pipeline(path, layer_split, spec, total // parallel, dtype, weights, device,
                                         {"slots": parallel})

        def new_llm():
            from kvcli.llama import Llama

            return Llama(path, ctx_size=total // parallel, dtype=dtype, cache_type_k=spec.type_k,
                         cache_type_v=spec.type_v, batch_size=batch_size, threads=threads, flash_attn=fa,
                         cache_mode=spec.mode, cache_type_h=spec.type_h, device=device, weights=weights,
                         cache_window=spec.window, cache_key_bias=spec.key_bias,
                    cache_key_scales=spec.key_scales, pipeline=stages)

        if stages is not None and not stages[0].first:  # a later stage: its layers of every step rank 0 launches
            _later_stage(new_llm(), parallel, say)

        from kvcli.serve.app import Server, serve

        def load():
            from kvcli.serve.engine import Engine

            llm = new_llm()
            c = llm.config
            server.n_ctx, server.spec = (total // parallel) * parallel, llm.cache_spec
            layers = f"{c.n_layers} layers" if llm.stage is None else f"{llm.gguf.config.n_layers} layers, " \
                f"{llm.stage.describe()}"
            log(f"model: {path.name} ({c.arch}, {layers}, {dtype} compute, {weights} weights, loaded in "
                f"{llm.load_seconds:.2f} s)")
            warn_known_loss(llm)
            from kvcli.serve.prompt_ram import PromptRam

            ram = None if cache_ram == 0 else PromptRam(None if cache_ram < 0 else cache_ram * MIB)
            return Engine(llm, parallel, queue, ram)

        server = Server(path.name, ctx_size, parallel, spec, api_key, slot_save_path)
        try:
            code = serve(load, server, host, port, log)
        finally:
            if stages is not None:  # the later stages' loops end with rank 0's
                stages[1].end()
    raise typer.Exit(code)


def _later_stage(llm, parallel: int, say) -> None:
    """A pipeline rank after the first, loaded: its slots' caches, its part of every step until rank 0 stops, then exit
    0 (rank 0 owns the HTTP side)."""
    from kvcli.serve.engine import slot_caches

    slot_caches(llm, parallel)
    say(f"{llm.stage.describe()}: {parallel} slots of {llm.n_ctx} tokens, serving rank 0's steps")
    try:
        llm.pipe.serve()
    finally:
        llm.pipe.close()
    raise typer.Exit(0)
