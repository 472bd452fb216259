"""`kvcli convert`: the command; the converter is kvcli.convert (the convert/ folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvcli.commands.common import log, user_errors


def convert_command(
    hf_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json, weights, tokenizer)."),
    out: Optional[Path] = typer.Option(None, "-o", "--outfile", show_default=False,
                                       help="GGUF file to write; a directory, or none (the model directory), gets a "
                                            "name as llama.cpp's converter gives, e.g. SmolLM2-135M-Instruct-F16.gguf."),
    outtype: str = typer.Option("f16", "--outtype", help="Weight type: f32, f16, bf16, q8_0 or q4_0."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
):
    """Convert a Hugging Face Llama, Mistral, Qwen2 or Qwen3 checkpoint to a llama.cpp-compatible GGUF file."""
    with user_errors():
        from kvcli.convert.hf_to_gguf import convert_hf  # imports torch: only when converting

        convert_hf(hf_dir, out, outtype=outtype.lower(), force=force, progress=True, log=log)
