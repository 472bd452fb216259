"""What every command shares, written once: one-line errors, logging, the model argument, reading
prompts, and the flags llama.cpp users type on every tool (-m, -c/--ctx, -t, -fa and the cache
flags with their validation). A leaf of the CLI layer: it imports no command, and no torch."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.text import Text

from kvcli.errors import KvcliError

if TYPE_CHECKING:  # kvcli.cache imports torch: only inside the commands, so `kvcli --help` stays instant
    from kvcli.cache import CacheSpec

err = Console(stderr=True, highlight=False)


@contextmanager
def user_errors():
    """KvcliError -> one line on stderr and exit code 1; never a traceback. The message is printed
    literally (a path such as `model[q4].gguf` keeps its brackets)."""
    try:
        yield
    except KvcliError as e:
        err.print(Text.assemble(("error:", "bold red"), f" {e}"), soft_wrap=True)
        raise typer.Exit(1) from None


def log(line: str) -> None:
    err.print(line, markup=False, soft_wrap=True)


# ---- the model: positional, as `kvcli run model.gguf`, or -m, as llama.cpp ----

ModelArg = typer.Argument(None, metavar="[MODEL]", show_default=False,
                          help="GGUF model file (the same as -m).")
ModelOpt = typer.Option(None, "-m", "--model",
                        help="GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).")


def resolve_model(positional: Optional[Path], option: Optional[Path] = None) -> Path:
    """The model a command runs: the positional argument or -m (not two different ones), else the
    default model, fetched on first use."""
    from kvcli.models import pull_default

    if positional is not None and option is not None and positional != option:
        raise KvcliError(f"two models given: {positional} (argument) and {option} (-m); give one")
    model = positional if positional is not None else option
    if model is None:
        return pull_default(log=log)
    if model.is_dir():
        raise KvcliError(f"{model} is a directory, not a GGUF model file")
    if not model.exists():
        raise KvcliError(f"model file not found: {model}")
    return model


def read_prompt(prompt: Optional[str], file: Optional[Path], encoding: str = "utf-8") -> str:
    if prompt is not None and file is not None:
        raise KvcliError("give the prompt with -p or -f, not both")
    if file is None:
        return prompt or ""
    if file.is_dir():
        raise KvcliError(f"{file} is a directory, not a prompt file")
    if not file.is_file():
        raise KvcliError(f"prompt file not found: {file}")
    data = file.read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise KvcliError(f"{file} is not valid {encoding} (byte offset {e.start}); pass --encoding") from None
    except LookupError:
        raise KvcliError(f"unknown --encoding {encoding!r}") from None


# ---- flags every model command takes ----

def ctx_option(default: int, help: str) -> typer.models.OptionInfo:
    """-c / --ctx-size, with --ctx as its alias."""
    return typer.Option(default, "-c", "--ctx-size", "--ctx", help=help)


ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (-1: all cores; default: torch's choice).")
MAX_THREADS = 1024


def parse_threads(threads: Optional[int]) -> Optional[int]:
    """-t as llama.cpp reads it: -1 is every core; 0, other negatives and absurd counts are refused."""
    import os

    if threads is None:
        return None
    if threads == -1:
        return os.cpu_count() or 1
    if not 1 <= threads <= MAX_THREADS:
        raise KvcliError(f"-t/--threads takes 1..{MAX_THREADS} or -1 (all cores), not {threads}")
    return threads
FlashOpt = typer.Option("auto", "-fa", "--flash-attn",
                        help="on: online-softmax attention over cache chunks; off: materialized scores; auto = on.")


# llama.cpp's offload flag: read as itself (not as -n gl), and answered with what kvcli does instead
GpuLayersOpt = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", hidden=True, metavar="N")


def note_gpu_layers(value: Optional[str]) -> None:
    if value is not None:
        log(f"note: -ngl {value} ignored: kvcli runs the whole model on one device; pick it with --device cpu|cuda")


def parse_flash_attn(value: str) -> bool:
    """llama.cpp's -fa on|off|auto (auto = on: the streamed path is never worse here)."""
    if value not in ("on", "off", "auto"):
        raise KvcliError(f"-fa/--flash-attn takes on, off or auto, not {value!r}")
    return value != "off"


# ---- the cache flags (None = not given, so a flag the mode would ignore is an error) ----

CtkOpt = typer.Option(None, "-ctk", "--cache-type-k", help="K cache storage type (default f16).")
CtvOpt = typer.Option(None, "-ctv", "--cache-type-v", help="V cache storage type (default f16).")
CacheModeOpt = typer.Option("kv", "--cache-mode", help="kv: cache K and V; hidden: cache each layer's normed input "
                                                       "and rebuild K/V; auto: hidden where smaller.")
CthOpt = typer.Option(None, "-cth", "--cache-type-h", help="Hidden-state cache storage type (default f16).")


def cache_spec(cache_mode: str, type_k: Optional[str], type_v: Optional[str], type_h: Optional[str]) -> "CacheSpec":
    """The cache flags as one validated choice; unknown type names and ignored flags fail here,
    before any model is loaded."""
    from kvcli.cache import CacheSpec, validate_cache_flags

    validate_cache_flags(cache_mode, type_k is not None, type_v is not None, type_h is not None)
    return CacheSpec(cache_mode, type_k or "f16", type_v or "f16", type_h or "f16")
