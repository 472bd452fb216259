"""The `kvcli` command line (Typer): the app and its wiring, nothing more. Each command's flags, checks
and output live in kvcli/commands/<command>.py; what they share (one-line errors, logging, the flags
every tool takes) in kvcli/commands/common.py.

Flags follow llama.cpp's names (-m, -p, -f, -n, -c, -ctk, -ctv, -cnv, ...). torch is
imported inside the commands so that `kvcli --help` is instant.
"""

from __future__ import annotations

import sys

import typer

from kvcli.commands.bench import bench_command
from kvcli.commands.common import OneLineErrors
from kvcli.commands.convert import convert_command
from kvcli.commands.fit import fit_command
from kvcli.commands.info import info_command
from kvcli.commands.perplexity import perplexity_command
from kvcli.commands.pull import pull_command
from kvcli.commands.run import run_command
from kvcli.commands.serve import serve_command

app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Run Llama-family GGUF models with a small KV cache (llama.cpp-style flags).")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"kvcli {version('kvcli')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print kvcli's version and exit.")):
    pass


# In this order in `kvcli --help`; a command's help is its docstring unless given here.
app.command("convert", short_help="Convert a Hugging Face checkpoint to GGUF.",
            help="Convert a Hugging Face Llama, Mistral, Qwen2 or Qwen3 checkpoint directory to a GGUF file.")(convert_command)
app.command("perplexity", short_help="Perplexity and KL divergence; --sweep compares caches.", help="Perplexity and KL divergence over a text file, llama-perplexity's method; "
                               "--sweep compares cache types.")(perplexity_command)
app.command("serve", short_help="An OpenAI-compatible server with parallel slots (llama-server).")(serve_command)
app.command("pull", short_help="Fetch the default model.")(pull_command)
app.command("run", short_help="Complete a prompt, or chat (llama-completion / llama-cli).")(run_command)
app.command("info", short_help="Model metadata, weights and cache bytes per token.")(info_command)
app.command("fit", short_help="The largest context per cache choice in a memory budget.")(fit_command)
app.command("bench", short_help="llama-bench: tokens/s and cache MiB per cache choice.")(bench_command)


def main() -> None:  # pragma: no cover - console script entry for `python -m kvcli`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
