"""`kvcli run --prompt-cache FILE`, with llama.cpp's meaning: the cache of a prompt kept in a state file
(kvcli/cache/state.py) between runs. A run restores it where the file exists, keeps the longest prefix its tokens
share with the new prompt, evaluates the rest, and saves after the prompt (with --prompt-cache-all, after the
generated tokens too; with --prompt-cache-ro, never). The chat keeps its conversation in it the same way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from kvcli.errors import KvcliError
from kvcli.memory import MIB


class PromptCache:
    def __init__(self, path: Path, save_all: bool, read_only: bool, log: Callable[[str], None]):
        if save_all and read_only:
            raise KvcliError("--prompt-cache-all saves the generated tokens and --prompt-cache-ro never saves: "
                             "give one of them")
        if path.is_dir():
            raise KvcliError(f"--prompt-cache takes a file, not the directory {path}")
        folder = path.resolve().parent
        if not read_only and not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise KvcliError(f"--prompt-cache {path}: cannot write in {folder}")
        self.path, self.save_all, self.read_only, self.log = path, save_all, read_only, log
        self.saved: tuple[int, int] | None = None  # (tokens, bytes) of the last save

    def restore(self, llm) -> tuple[list[int], dict]:
        """Into llm's sequence 0 where the file exists: its token ids and what it was saved with; else none."""
        if not self.path.exists():
            if self.read_only:
                raise KvcliError(f"--prompt-cache-ro: {self.path} does not exist")
            self.log(f"prompt cache: {self.path} does not exist yet; it is written after the prompt")
            return [], {}
        tokens, extra = llm.load_state(self.path)
        self.log(f"prompt cache: {len(tokens)} tokens restored from {self.path} ({llm.loaded_bytes / MIB:.2f} MiB)")
        return tokens, extra

    def save(self, llm, extra: dict | None = None) -> None:
        """Write llm's sequence 0 (quietly: `report` says what was last written, after the output)."""
        if not self.read_only:
            self.saved = (llm.n_past, llm.save_state(self.path, extra))

    def report(self) -> None:
        if self.saved is not None:
            self.log(f"prompt cache: {self.saved[0]} tokens saved to {self.path} ({self.saved[1] / MIB:.2f} MiB)")
