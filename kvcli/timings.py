"""The prompt and eval timings of a run: llama.cpp's perf counters and lines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timings:
    """llama.cpp's perf counters: load, prompt eval, eval, and the wall time since `started`."""
    load_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    eval_tokens: int = 0
    eval_seconds: float = 0.0
    context_full: bool = False

    def add_prompt(self, n: int, seconds: float) -> None:
        self.prompt_tokens += n
        self.prompt_seconds += seconds

    def add_eval(self, n: int, seconds: float) -> None:
        self.eval_tokens += n
        self.eval_seconds += seconds

    def report(self) -> list[str]:
        """llama.cpp's perf lines: time, tokens, ms per token, tokens per second."""
        total_ms = (time.perf_counter() - self.started) * 1000
        return [f"       load time = {self.load_seconds * 1000:10.2f} ms",
                self._line("prompt eval time", self.prompt_seconds, self.prompt_tokens, "tokens"),
                self._line("       eval time", self.eval_seconds, self.eval_tokens, "runs  "),
                f"      total time = {total_ms:10.2f} ms / {self.prompt_tokens + self.eval_tokens:5d} tokens"]

    @staticmethod
    def _line(label: str, seconds: float, n: int, unit: str) -> str:
        ms = seconds * 1000
        per = ms / n if n else 0.0
        tps = n / seconds if seconds > 0 else 0.0
        return f"{label} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
