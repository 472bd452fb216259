"""The chat as llama-cli's (issue 14, point 3), in a pseudo-terminal with the real default model:
no prompt starts it, -cnv -p is the system prompt, Ctrl-C stops a reply and returns to the
prompt, Ctrl-C at the prompt or Ctrl-D ends the session; a model without a template is refused."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from cli_checks import assert_clean_error, default_sigint, run

pexpect = pytest.importorskip("pexpect")

PROMPT = "\r\n> "
QUESTION = "Who are you?"


def _spawn(default_model, *args):
    kvcli = shutil.which("kvcli", path=str(Path(sys.executable).parent)) or "kvcli"
    env = dict(os.environ, KVCLI_MODELS=str(default_model.parent), COLUMNS="200")
    child = pexpect.spawn(kvcli, ["run", "--temp", "0", *map(str, args)], env=env, encoding="utf-8", timeout=120,
                          preexec_fn=default_sigint,
                          dimensions=(50, 200))
    child.expect_exact("chat mode")
    child.expect_exact(PROMPT)
    return child


def _ask(child, text: str) -> str:
    """Send one user turn; the reply printed before the next prompt."""
    child.sendline(text)
    child.expect_exact(text)  # the terminal's echo of the turn
    child.expect_exact(PROMPT)
    return child.before.strip()


def _end(child) -> int:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_system_prompt_changes_the_reply(default_model):
    plain = _spawn(default_model, "-n", 24)  # no prompt on a model with a template: the chat
    without = _ask(plain, QUESTION)
    assert _end(plain) == 0
    pirate = _spawn(default_model, "-n", 24, "-cnv", "-p", "You are a pirate. Always answer like a pirate, matey.")
    with_system = _ask(pirate, QUESTION)
    assert _end(pirate) == 0
    assert without and with_system and without != with_system


def test_ctrl_c_stops_the_reply_and_ctrl_d_ends(default_model):
    child = _spawn(default_model, "-n", 400, "--ignore-eos")
    child.sendline("Write a long story about a cat.")
    child.expect_exact("story about a cat.")
    child.expect(r"\w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[reply stopped")
    child.expect_exact(PROMPT)  # back at the prompt, the session goes on
    assert _ask(child, "Thanks. And what is 2+2?")
    child.sendeof()
    child.expect_exact("total time")  # the timings, on a line of their own
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_at_the_prompt_ends_the_session(default_model):
    child = _spawn(default_model, "-n", 8)
    child.sendintr()
    child.expect_exact("total time")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_model_without_template_is_refused_before_the_first_message(tiny):
    assert_clean_error(run("-m", tiny, "-cnv", input="hello\n"), "no chat template")
    assert_clean_error(run("-m", tiny, input="hello\n"), "empty prompt", "no chat template")


def test_no_cnv_forces_completion(tiny):
    r = run("-m", tiny, "-no-cnv", "-p", "ab", "-n", 3, "--temp", 0)
    assert r.exit_code == 0 and "chat mode" not in r.stderr, r.output
    assert_clean_error(run("-m", tiny, "-no-cnv"), "empty prompt")
