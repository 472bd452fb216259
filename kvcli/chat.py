"""Streaming text to the terminal: one-shot completion (llama-completion) and the interactive chat
(llama-cli), with their Ctrl-C, reverse-prompt and end-of-text behaviour."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvcli.errors import KvcliError
from kvcli.sampler import Sampler
from kvcli.timings import Timings


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _silence_stdout() -> None:
    """After a closed pipe (`kvcli run ... | head`): send further output nowhere, quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


@dataclass
class Reply:
    """What one generation produced so far; filled in place, so it survives a Ctrl-C."""
    ids: list[int] = field(default_factory=list)  # sampled ids (an end-of-generation id included)
    text: str = ""                                 # the text printed
    end_of_text: bool = False                      # stopped at an end-of-generation token
    reverse_prompt: bool = False                   # stopped at a -r string


def _stream(llm, ids: list[int], sampler: Sampler, n_predict: int, timings: Timings, stops: Sequence[str],
            reply: Reply) -> None:
    """Generate after ids, printing whole UTF-8 characters as they complete, until an
    end-of-generation token, a -r string at the end of the text, n_predict or a full context."""
    stream = llm.tokenizer.stream()
    eog = llm.tokenizer.eog_ids
    for token in llm.generate(ids, n_predict, sampler, timings):
        reply.ids.append(token)
        if token in eog:
            reply.end_of_text = True
            break
        piece = stream.push(token)
        _write(piece)
        reply.text += piece
        # as llama.cpp: a stop string found in the tail of the output (a token may run past its end)
        if any(s in reply.text[-(len(s) + 16):] for s in stops):
            reply.reverse_prompt = True
            break  # the generator stops; the last sampled token was not evaluated into the cache
    tail = stream.flush()
    _write(tail)
    reply.text += tail


def check_prompt_fits(llm, n_tokens: int) -> None:
    if n_tokens >= llm.n_ctx - llm.n_past:
        raise KvcliError(f"prompt is {n_tokens} tokens, longer than the {llm.n_ctx - llm.n_past} left in the "
                         f"{llm.n_ctx}-token context; raise -c/--ctx-size")


def complete(llm, text: str, sampler: Sampler, n_predict: int, display_prompt: bool, log: Callable,
             timings: Timings, stops: Sequence[str] = ()) -> int:
    """Exit code: 0, or 130 after Ctrl-C (the timings so far are printed either way)."""
    ids = llm.tokenize(text, special=True)  # as llama-completion: control tokens in the prompt are parsed
    if not ids:
        raise KvcliError("empty prompt: it tokenizes to no tokens")
    check_prompt_fits(llm, len(ids))
    code, reply = 0, Reply()
    try:
        if display_prompt:
            _write(text)
        _stream(llm, ids, sampler, n_predict, timings, stops, reply)
        _write(" [end of text]\n" if reply.end_of_text else "\n")  # llama-completion's marker, on stdout
    except KeyboardInterrupt:
        _write("\n")  # the timings start on a line of their own
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share (the cached prefix a new prompt keeps: the chat, a server slot)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat_loop(llm, sampler: Sampler, n_predict: int, system: str | None, log: Callable, timings: Timings,
              stops: Sequence[str] = ()) -> int:
    """llama-cli's chat: read user turns from stdin, render the whole conversation with the model's
    template and evaluate only the tokens past what the cache already holds.

    Ctrl-C during a reply stops it and returns to the prompt (the partial reply stays in the
    conversation); Ctrl-C at the prompt, Ctrl-D or /exit ends the session."""
    tok = llm.tokenizer
    if not tok.chat_template:
        raise KvcliError("this model has no chat template (tokenizer.chat_template), so it cannot chat; "
                         "give a prompt with -p or -f for a completion")
    messages = [{"role": "system", "content": system}] if system else []
    cached: list[int] = []  # the ids in the cache, in order (the first llm.n_past are valid)
    interactive = sys.stdin.isatty()
    log("chat mode: type a message; Ctrl-C stops a reply, Ctrl-D or /exit quits")
    code = 0
    try:
        while True:
            if interactive:
                _write("\n> ")
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the session, as llama-cli
                _write("\n")
                code = 130
                break
            if not line or line.strip() == "/exit":
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), parse_special=True)
            # keep the cached prefix this rendering shares (at least one new token is evaluated)
            llm.n_past = min(common_prefix(cached[:llm.n_past], ids), len(ids) - 1)
            check_prompt_fits(llm, len(ids) - llm.n_past)
            reply = Reply()
            try:
                _stream(llm, ids[llm.n_past:], sampler, n_predict, timings, stops, reply)
                _write("\n")
            except KeyboardInterrupt:
                _write("\n")
                log("[reply stopped: Ctrl-C again or Ctrl-D quits]")
            cached = ids + reply.ids
            messages.append({"role": "assistant", "content": reply.text})
            if timings.context_full:
                break
    except BrokenPipeError:
        _silence_stdout()
    _finish(llm, timings, log)
    return code
