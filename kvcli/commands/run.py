"""`kvcli run`: complete a prompt (llama-completion) or chat (llama-cli); the loops are kvcli/chat.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvcli.commands.common import (CacheModeOpt, CthOpt, LayerSplitOpt, PipelineOpt, CtkOpt, CtvOpt, DtypeOpt, FlashOpt, ModelArg, ModelOpt,
                                   ThreadsOpt, WeightsOpt, WindowOpt, KeyBiasOpt, KeyScalesOpt, cache_spec, warn_known_loss, ctx_option, log, parse_device,
                                   parse_dtype, parse_flash_attn, parse_threads, parse_weights, process_escapes,
                                   read_prompt, resolve_model, user_errors)
from kvcli.errors import KvcliError
from kvcli.memory import MIB


def run_command(
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
    key_bias: str = KeyBiasOpt,
    key_scales: str = KeyScalesOpt,
    flash_attn: str = FlashOpt,
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt", help="Echo the prompt."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the model and its cache run."),
    prompt_cache: Optional[Path] = typer.Option(None, "--prompt-cache", help="Keep the prompt's cache in this file "
                                                "(llama.cpp's): restored where it exists and its tokens begin the "
                                                "prompt, saved after the prompt; the chat keeps its conversation."),
    prompt_cache_all: bool = typer.Option(False, "--prompt-cache-all",
                                          help="With --prompt-cache: save the generated tokens too."),
    prompt_cache_ro: bool = typer.Option(False, "--prompt-cache-ro",
                                         help="With --prompt-cache: restore from the file, never write it."),
    pipeline: bool = PipelineOpt,
    layer_split: Optional[str] = LayerSplitOpt,
):
    """Complete a prompt (llama-completion), or chat through the model's template (llama-cli): with
    no prompt on a model that has a chat template, or with -cnv (then -p/-f is the system prompt).
    In the chat, Ctrl-C stops a reply, and Ctrl-C at the prompt or Ctrl-D ends it."""
    with user_errors():
        spec = cache_spec(cache_mode, cache_type_k, cache_type_v, cache_type_h, cache_window, key_bias,
                          key_scales)  # fail before loading
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
        if (prompt_cache_all or prompt_cache_ro) and prompt_cache is None:
            raise KvcliError("--prompt-cache-all and --prompt-cache-ro go with --prompt-cache FILE")
        from kvcli.prompt_cache import PromptCache

        cache_file = PromptCache(prompt_cache, prompt_cache_all, prompt_cache_ro, log) if prompt_cache else None
        path = resolve_model(model_arg, model)

        from kvcli.llama import Llama
        from kvcli.pipeline import start as start_pipeline

        stages, say = start_pipeline(path, layer_split, spec, ctx_size, dtype, weights, device) if pipeline else (None, log)
        if layer_split is not None and not pipeline:
            raise KvcliError("--layer-split goes with --pipeline")
        llm = Llama(path, ctx_size=ctx_size, dtype=dtype, cache_type_k=spec.type_k, cache_type_v=spec.type_v,
                    batch_size=batch_size, threads=threads, flash_attn=fa, log=say,
                    cache_mode=spec.mode, cache_type_h=spec.type_h, device=device, weights=weights,
                    cache_window=spec.window, cache_key_bias=spec.key_bias,
                    cache_key_scales=spec.key_scales, pipeline=stages)
        if stages is not None and not stages[0].first:  # a later stage: its layers for rank 0's steps, then exit 0
            llm.pipe.serve()
            llm.pipe.close()
            raise typer.Exit(0)
        try:
            code = _after_load(llm, path, dtype, weights, conversation, text, temp, top_k, top_p, min_p,
                               repeat_penalty, repeat_last_n, seed, ignore_eos, n_predict, system_prompt,
                               reverse_prompt, cache_file, display_prompt)
        finally:
            if llm.pipe is not None:
                llm.pipe.end()
    raise typer.Exit(code)


def _after_load(llm, path, dtype, weights, conversation, text, temp, top_k, top_p, min_p, repeat_penalty,
                repeat_last_n, seed, ignore_eos, n_predict, system_prompt, reverse_prompt, cache_file,
                display_prompt) -> int:
    """Rank 0's (or the one process's) part once the model is loaded: the chat or the completion; its exit code."""
    from kvcli.chat import chat_loop, complete
    from kvcli.sampler import Sampler
    from kvcli.timings import Timings

    c = llm.config
    layers = f"{c.n_layers} layers" if llm.stage is None else f"{llm.gguf.config.n_layers} layers, {llm.stage.describe()}"
    log(f"model: {path.name} ({c.arch}, {layers}, n_embd {c.n_embd}, {c.n_heads}/{c.n_kv_heads} heads, "
        f"{llm.n_ctx} ctx, {dtype} compute, {weights} weights {llm.model.weight_bytes() / MIB:.1f} MiB, loaded in {llm.load_seconds:.2f} s)")
    warn_known_loss(llm)
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
        return chat_loop(llm, sampler, n_predict, system_prompt or text or None, log, timings, reverse_prompt,
                         cache_file)
    return complete(llm, text, sampler, n_predict, display_prompt, log, timings, reverse_prompt, cache_file)
