"""Shared CLI test helpers: run `kvcli run` in-process and check a clean one-line error."""

from typer.testing import CliRunner

from kvcli.cli import app

runner = CliRunner()


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
