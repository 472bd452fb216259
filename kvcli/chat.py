"""Streaming text to the terminal: one-shot completion (llama-completion) and the interactive chat
(llama-cli), with their Ctrl-C, reverse-prompt and end-of-text behaviour."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvcli.errors import KvcliError
from kvcli.prompt_cache import PromptCache
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
            reply: Reply, after_prompt: Callable[[], None] | None = None) -> None:
    """Generate after ids, printing whole UTF-8 characters as they complete, until an
    end-of-generation token, a -r string at the end of the text, n_predict or a full context.
    after_prompt: called once the prompt is in the cache (before the first token is printed)."""
    stream = llm.tokenizer.stream()
    eog = llm.tokenizer.eog_ids
    for token in llm.generate(ids, n_predict, sampler, timings):
        if after_prompt is not None and not reply.ids:
            after_prompt()
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
             timings: Timings, stops: Sequence[str] = (), cache_file: PromptCache | None = None) -> int:
    """Exit code: 0, or 130 after Ctrl-C (the timings so far are printed either way). cache_file: --prompt-cache's
    (the prompt starts after the longest prefix it holds; saved after the prompt, or at the end with -all)."""
    ids = llm.tokenize(text, special=True)  # as llama-completion: control tokens in the prompt are parsed
    if not ids:
        raise KvcliError("empty prompt: it tokenizes to no tokens")
    check_prompt_fits(llm, len(ids))
    save_now = None
    if cache_file is not None:
        restored, _ = cache_file.restore(llm)
        shared = common_prefix(restored, ids)
        # the prefix kept; at least the last prompt token is evaluated again, for its logits (as llama.cpp)
        llm.n_past = min(shared, len(ids) - 1)
        if restored:
            log(f"prompt cache: {llm.n_past} of the prompt's {len(ids)} tokens reused")
        if not cache_file.save_all and shared < len(ids):  # as llama.cpp: a file holding the whole prompt stays
            save_now = lambda: cache_file.save(llm)  # noqa: E731
    code, reply = 0, Reply()
    try:
        if display_prompt:
            _write(text)
        _stream(llm, ids[llm.n_past :], sampler, n_predict, timings, stops, reply, save_now)
        _write(" [end of text]\n" if reply.end_of_text else "\n")  # llama-completion's marker, on stdout
        if cache_file is not None and cache_file.save_all:
            cache_file.save(llm)
    except KeyboardInterrupt:
        _write("\n")  # the timings start on a line of their own
        code = 130
    except BrokenPipeError:
        _silence_stdout()
    _finish(llm, timings, log, cache_file)
    return code


def _finish(llm, timings: Timings, log: Callable, cache_file: PromptCache | None = None) -> None:
    if cache_file is not None:
        cache_file.report()
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
              stops: Sequence[str] = (), cache_file: PromptCache | None = None) -> int:
    """llama-cli's chat: read user turns from stdin, render the whole conversation with the model's
    template and evaluate only the tokens past what the cache already holds.

    Ctrl-C during a reply stops it and returns to the prompt (the partial reply stays in the
    conversation); Ctrl-C at the prompt, Ctrl-D or /exit ends the session. cache_file: --prompt-cache's: the
    conversation it holds goes on (its messages and their cache), and it is saved after each reply."""
    tok = llm.tokenizer
    if not tok.chat_template:
        raise KvcliError("this model has no chat template (tokenizer.chat_template), so it cannot chat; "
                         "give a prompt with -p or -f for a completion")
    messages = [{"role": "system", "content": system}] if system else []
    cached: list[int] = []  # the ids in the cache, in order (the first llm.n_past are valid)
    if cache_file is not None:
        cached, extra = cache_file.restore(llm)
        saved = _messages(extra)
        if saved and (system is None or saved[0] == messages[0]):
            messages = saved
            log(f"prompt cache: the conversation goes on after its {len(saved)} messages")
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
            if cache_file is not None:
                cache_file.save(llm, {"messages": messages})
            if timings.context_full:
                break
    except BrokenPipeError:
        _silence_stdout()
    _finish(llm, timings, log, cache_file)
    return code


def _messages(extra: dict) -> list[dict]:
    """The chat messages a prompt cache file was saved with ([] where it holds none in their form)."""
    saved = extra.get("messages")
    ok = isinstance(saved, list) and all(isinstance(m, dict) and set(m) == {"role", "content"}
                                          and all(isinstance(v, str) for v in m.values()) for m in saved)
    return saved if ok else []
