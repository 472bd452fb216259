"""Shared CLI test helpers: run `kvcli run` in-process, check a clean one-line error, a free port for a server."""

import signal
import socket

from typer.testing import CliRunner

from kvcli.cli import app

runner = CliRunner()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a server or torchrun's rendezvous started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, **kw):
    return runner.invoke(app, ["run", *map(str, args)], **kw)


def assert_clean_error(result, *words, code=1):
    """Exit code `code` (1; 2 for a usage error, as click), no traceback, exactly one `error:` line
    (the last), naming each of `words`."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    for w in words:
        assert w in errors[0], errors[0]


def default_sigint() -> None:
    """A child's SIGINT as a terminal's (preexec_fn): a test run started in the background (`pytest &`) hands its
    children SIGINT ignored, and Python then never raises KeyboardInterrupt, so a Ctrl-C test would see nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
