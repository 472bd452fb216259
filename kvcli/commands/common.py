"""What every command shares, written once: one-line errors, logging, the model argument, reading
prompts, the flags llama.cpp users type on every tool (-m, -c/--ctx, -t, -fa and the cache
flags with their validation) and the tables commands print. A leaf of the CLI layer: it imports no
command, and no torch."""

from __future__ import annotations

import string
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from typer.core import TyperGroup
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


class OneLineErrors(TyperGroup):
    """The command group: a usage error (`-t abc`, an unknown flag, a missing value) is one line and
    exit code 2, as every other error is one line; a bare `-fa` means `-fa on`, as it did in llama.cpp."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = bare_flash_attn(list(sys.argv[1:] if args is None else args))
        try:
            args, offload = strip_offload_flags(args)
        except KvcliError as e:
            err.print(Text.assemble(("error:", "bold red"), f" {e} (see `kvcli --help`)"), soft_wrap=True)
            sys.exit(2)
        if offload:
            log(f"note: {' '.join(offload)} ignored: kvcli runs the whole model on one device; "
                f"pick it with --device cpu|cuda")
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:  # click's usage errors (typer vendors click)
            where = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `kvcli`: the help, as --help
                typer.echo(where.get_help())
                sys.exit(0)
            path = where.command_path if where is not None else " ".join(
                ["kvcli"] + [a for a in args[:1] if a in self.commands])
            hint = f" (see `{path} --help`)"
            err.print(Text.assemble(("error:", "bold red"), f" {e.format_message()}{hint}"), soft_wrap=True)
            sys.exit(e.exit_code)
        except typer.Abort:  # Ctrl-C or Ctrl-D outside a command's own handling
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


FLASH_ATTN_FLAGS = ("-fa", "--flash-attn")


def bare_flash_attn(args: list[str]) -> list[str]:
    """`-fa` with no value (at the end, or before another flag) -> `-fa on`."""
    out = []
    for i, a in enumerate(args):
        out.append(a)
        if a in FLASH_ATTN_FLAGS and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("on")
    return out


def log(line: str) -> None:
    err.print(line, markup=False, soft_wrap=True)


def rich_table(title: str, columns: list[str], rows: list[list[str]]):
    """A rich Table: the first column left-aligned, the others right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*r)
    return table


# ---- the model: positional, as `kvcli run model.gguf`, or -m, as llama.cpp ----

ModelArg = typer.Argument(None, metavar="MODEL", show_default=False,
                          help="GGUF model file (the same as -m).")
ModelOpt = typer.Option(None, "-m", "--model",
                        help="GGUF model file, or a name from `kvcli pull --list` (default: SmolLM2-135M-Instruct "
                             "Q4_1, fetched on first use).")


def resolve_model(positional: Optional[Path], option: Optional[Path] = None) -> Path:
    """The model a command runs: the positional argument or -m (not two different ones), else the
    default model, fetched on first use. A name of the catalog (`-m qwen2.5-coder-0.5b`) is the file
    `kvcli pull NAME` fetched; a file of that name, if there is one, comes first."""
    from kvcli.catalog import CATALOG
    from kvcli.pull import pull_default

    if positional is not None and option is not None and positional != option:
        raise KvcliError(f"two models given: {positional} (argument) and {option} (-m); give one")
    model = positional if positional is not None else option
    if model is None:
        return pull_default(log=log)
    if model.is_dir():
        raise KvcliError(f"{model} is a directory, not a GGUF model file")
    if not model.exists():
        named = CATALOG.get(str(model))
        if named is None:
            raise KvcliError(f"model file not found: {model} (nor a name from `kvcli pull --list`)")
        if not named.path().is_file():
            raise KvcliError(f"{model} is not pulled yet: run `kvcli pull {model}` ({named.path()} not found)")
        return named.path()
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


def process_escapes(text: str) -> str:
    r"""llama.cpp's -e: \n \r \t \' \" \\ and \xHH (a byte) become what they name; any other
    backslash is kept as it is."""
    simple = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\"}
    out, i = bytearray(), 0
    while i < len(text):
        nxt, hex2 = text[i + 1 : i + 2], text[i + 2 : i + 4]
        if text[i] == "\\" and nxt in simple and nxt:
            out += simple[nxt]
            i += 2
        elif text[i] == "\\" and nxt == "x" and len(hex2) == 2 and all(h in string.hexdigits for h in hex2):
            out.append(int(hex2, 16))
            i += 4
        else:
            out += text[i].encode("utf-8", "surrogatepass")
            i += 1
    return out.decode("utf-8", "replace")


# ---- flags every model command takes ----

DTYPES = ("f32", "f16", "bf16")
DEVICES = ("cpu", "cuda")


def parse_dtype(value: str) -> str:
    """--dtype: f32, f16 or bf16 (any case)."""
    if value.lower() not in DTYPES:
        raise KvcliError(f"--dtype takes f32, f16 or bf16, not {value!r}")
    return value.lower()


def parse_device(value: str) -> str:
    if value not in DEVICES:
        raise KvcliError(f"--device takes cpu or cuda, not {value!r}")
    return value


DtypeOpt = typer.Option("f16", "--dtype", help="Compute dtype of the activations (and of matrices kept dense): f16 "
                                               "(the default), bf16, or f32 (the exact reference, with --weights f32).")
WeightsOpt = typer.Option("native", "--weights", help="Resident weights: native (the ggml types in the "
                                                      "file's own blocks, regrouped 8 rows at a time with AVX2; "
                                                      "Q4_* packed int4 without AVX2; the rest dense at --dtype; the "
                                                      "default), f16, or f32 (every matrix dense; f32 is the "
                                                      "exact reference).")


def parse_weights(value: str) -> str:
    """--weights: native, f16 or f32 (any case)."""
    from kvcli.weights import WEIGHTS

    if value.lower() not in WEIGHTS:
        raise KvcliError(f"--weights takes native, f16 or f32, not {value!r}")
    return value.lower()

def ctx_option(default: int, help: str) -> typer.models.OptionInfo:
    """-c / --ctx-size, with --ctx as its alias."""
    return typer.Option(default, "-c", "--ctx-size", "--ctx", help=help)


PipelineOpt = typer.Option(False, "--pipeline", help="Run as one stage of the model's layers under torchrun (e.g. "
                           "torchrun --nproc-per-node 2 -m kvcli.cli run ... --pipeline): each rank loads and caches "
                           "its layers only, rank 0 reads and writes.")
LayerSplitOpt = typer.Option(None, "--layer-split", help="With --pipeline: layers per rank, e.g. 10,14 (default: even).")
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (-1: all cores; default: the cores idle at "
                                                         "start).")
MAX_THREADS = 1024


def parse_threads(threads: Optional[int]) -> int:
    """-t as llama.cpp reads it: -1 is every core; 0, other negatives and absurd counts are refused.
    Not given: the cores idle at start (kvcli.threads says why)."""
    import os

    from kvcli.threads import default_threads

    if threads is None:
        return default_threads(log)
    if threads == -1:
        return os.cpu_count() or 1
    if not 1 <= threads <= MAX_THREADS:
        raise KvcliError(f"-t/--threads takes 1..{MAX_THREADS} or -1 (all cores), not {threads}")
    return threads


FlashOpt = typer.Option("auto", "-fa", "--flash-attn",
                        help="on (or bare -fa): online-softmax attention over cache chunks; off: materialized "
                             "scores; auto = on.")


# llama.cpp's GPU-offload flags (and how many values each takes): accepted on every command and
# answered with one note, since kvcli runs the whole model on the one device --device picks.
OFFLOAD_FLAGS = {"-ngl": 1, "--n-gpu-layers": 1, "--gpu-layers": 1, "-sm": 1, "--split-mode": 1, "-mg": 1,
                 "--main-gpu": 1, "-ts": 1, "--tensor-split": 1, "-nkvo": 0, "--no-kv-offload": 0}


def strip_offload_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(args without the offload flags, the flags taken out with their values)."""
    kept, dropped, i = [], [], 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        n = OFFLOAD_FLAGS.get(flag)
        if n is None:
            kept.append(args[i])
            i += 1
            continue
        if n and not inline and (i + 1 >= len(args) or args[i + 1].startswith("--")):
            raise KvcliError(f"option {flag} requires an argument")
        taken = args[i : i + 1 + (0 if inline else n)]
        dropped += taken
        i += len(taken)
    return kept, dropped


FLASH_ATTN_VALUES = {"on": True, "enabled": True, "true": True, "1": True, "auto": True,
                     "off": False, "disabled": False, "false": False, "0": False}


def parse_flash_attn(value: str) -> bool:
    """llama.cpp's -fa on|off|auto and its spellings (auto = on: the streamed path is never worse here)."""
    if value.lower() not in FLASH_ATTN_VALUES:
        raise KvcliError(f"-fa/--flash-attn takes on, off or auto, not {value!r}")
    return FLASH_ATTN_VALUES[value.lower()]


# ---- the cache flags (None = not given, so a flag the mode would ignore is an error) ----

CtkOpt = typer.Option(None, "-ctk", "--cache-type-k", help="K cache storage type (default f16).")
CtvOpt = typer.Option(None, "-ctv", "--cache-type-v", help="V cache storage type (default f16).")
CacheModeOpt = typer.Option("kv", "--cache-mode", help="kv: cache K and V; hidden: cache each layer's normed input "
                                                       "and rebuild K/V; auto: hidden where smaller.")
CthOpt = typer.Option(None, "-cth", "--cache-type-h", help="Hidden-state cache storage type (default f16).")
WINDOW_HELP = ("Newest positions per layer kept in f16 and quantized only when they leave (default: the cache "
               "type's: 0 for llama.cpp's types; none for f32/f16/bf16, which need none).")
# click's range check: a negative or non-integer count is a usage error (one line, exit code 2)
WindowOpt = typer.Option(None, "-cw", "--cache-window", min=0, help=WINDOW_HELP)
KeyBiasOpt = typer.Option("auto", "--key-bias", help="Store keys less their turning mean R(p)m (m: the K bias plus "
                          "the projections' mean over each sequence's first batch) and add q.R(p)m back on read: "
                          "auto (kvcli's rotated types), on (any quantized K type), off.")
KeyScalesOpt = typer.Option("auto", "--key-scales", help="Keep keys scaled per channel for the queries that read them "
                            "(q*s . k/s, s from the model's weights), so a quantized K store errs where queries look "
                            "least: auto (kvcli's rotated types, where the weights predict a gain), on, off.")


def warn_known_loss(llm) -> None:
    """The one-line warning where this cache choice is known to lose more than 1% perplexity on the model's family
    (kvcli/cache/known_loss.py)."""
    from kvcli.cache.known_loss import loss_warning
    from kvcli.cache.spec import scaled_keys, treats_keys

    spec = llm.cache_spec
    line = loss_warning(llm.config, spec, bool(treats_keys(llm.config, spec)), bool(scaled_keys(llm.model, spec)))
    if line:
        log(line)


def cache_spec(cache_mode: str, type_k: Optional[str], type_v: Optional[str], type_h: Optional[str],
               window: Optional[int] = None, key_bias: str = "auto", key_scales: str = "auto") -> "CacheSpec":
    """The cache flags as one validated choice; unknown type names and ignored flags fail here,
    before any model is loaded. A window given for dense types only is noted and dropped."""
    from kvcli.cache import CacheSpec, validate_cache_flags

    validate_cache_flags(cache_mode, type_k is not None, type_v is not None, type_h is not None)
    spec = CacheSpec(cache_mode, type_k or "f16", type_v or "f16", type_h or "f16", window, key_bias, key_scales)
    if window and spec.mode != "auto" and not spec.window:
        log(f"note: --cache-window {window} ignored: {spec.label} is not quantized, so it needs no f16 window")
    return spec
