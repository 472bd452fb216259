"""Streaming text to the terminal: one-shot completion and the interactive chat loop."""

from __future__ import annotations

import os
import sys
from typing import Callable

from kvcli.errors import KvcliError
from kvcli.generate import Sampler, Timings


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _silence_stdout() -> None:
    """After a closed pipe (`kvcli run ... | head`): send further output nowhere, quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _stream(llm, ids: list[int], sampler: Sampler, n_predict: int, timings: Timings) -> list[int]:
    """Generate after ids, printing whole UTF-8 characters as they complete; returns the new ids."""
    stream = llm.tokenizer.stream()
    produced = []
    for token in llm.generate(ids, n_predict, sampler, timings):
        produced.append(token)
        if token not in llm.tokenizer.eog_ids:
            _write(stream.push(token))
    _write(stream.flush())
    return produced


def check_prompt_fits(llm, n_tokens: int) -> None:
    if n_tokens >= llm.n_ctx - llm.n_past:
        raise KvcliError(f"prompt is {n_tokens} tokens, longer than the {llm.n_ctx - llm.n_past} left in the "
                         f"{llm.n_ctx}-token context; raise -c/--ctx-size")


def complete(llm, text: str, sampler: Sampler, n_predict: int, display_prompt: bool, log: Callable) -> int:
    """Exit code: 0, or 130 after Ctrl-C (the timings so far are printed either way)."""
    ids = llm.tokenize(text, special=True)  # as llama-completion: control tokens in the prompt are parsed
    if not ids:
        raise KvcliError("empty prompt: it tokenizes to no tokens")
    check_prompt_fits(llm, len(ids))
    timings, code = Timings(), 0
    try:
        if display_prompt:
            _write(text)
        _stream(llm, ids, sampler, n_predict, timings)
        _write("\n")
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        _silence_stdout()
    _finish(llm, timings, log)
    return code


def _finish(llm, timings: Timings, log: Callable) -> None:
    if timings.context_full:
        log(f"context full ({llm.n_ctx} tokens): generation stopped; raise -c/--ctx-size for longer output")
    for line in timings.report():
        log(line)


def chat_loop(llm, sampler: Sampler, n_predict: int, system: str | None, log: Callable) -> int:
    """Read user turns from stdin; render the whole conversation with the model's chat
    template and feed only the text past what the cache already holds (as llama-cli does)."""
    tok = llm.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    cached_text = ""
    timings = Timings()
    interactive = sys.stdin.isatty()
    log("chat mode: type a message, Ctrl-D or /exit to quit")
    try:
        while True:
            if interactive:
                _write("\n> ")
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
            if not rendered.startswith(cached_text):  # template rewrote history: start over
                llm.reset()
                cached_text = ""
            new_ids = tok.encode(rendered[len(cached_text):], add_bos=None if llm.n_past == 0 else False, parse_special=True)
            check_prompt_fits(llm, len(new_ids))
            reply_ids = _stream(llm, new_ids, sampler, n_predict, timings)
            _write("\n")
            reply_ids = [t for t in reply_ids if t not in tok.eog_ids]
            reply = tok.decode(reply_ids)
            messages.append({"role": "assistant", "content": reply})
            cached_text = rendered + reply  # the EOG token was not evaluated into the cache
            if timings.context_full:
                break
    except KeyboardInterrupt:
        _finish(llm, timings, log)
        return 130
    except BrokenPipeError:
        _silence_stdout()
    _finish(llm, timings, log)
    return 0
