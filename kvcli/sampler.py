"""Sampling: llama.cpp's chain (repeat penalty, top-k, top-p, min-p, temperature) and its defaults."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Sampler:
    """llama.cpp's order: repeat penalty -> top-k -> top-p -> min-p -> temperature -> draw.
    temp <= 0 is greedy (argmax after the penalty), deterministic. seed -1 draws one (kept in
    .seed, so it can be printed and the run repeated). banned ids are never drawn (--ignore-eos)."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1
    banned: frozenset[int] = frozenset()
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if self.seed < 0:
            self.seed = secrets.randbits(32)  # llama.cpp's seeds are 32-bit too
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed)
        self._banned = torch.tensor(sorted(self.banned), dtype=torch.long)

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """logits (V,) f32 for the next position; history: the ids so far (prompt included)."""
        if self.banned:
            logits = logits.index_fill(0, self._banned.to(logits.device), float("-inf"))
        if self.repeat_penalty != 1.0 and self.repeat_last_n != 0 and history:
            recent = history if self.repeat_last_n < 0 else history[-self.repeat_last_n :]
            ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
            vals = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(vals > 0, vals / self.repeat_penalty, vals * self.repeat_penalty)
        if self.temp <= 0:
            return int(torch.argmax(logits))
        k = logits.shape[-1] if self.top_k <= 0 else min(self.top_k, logits.shape[-1])
        vals, ids = torch.topk(logits, k)  # sorted, descending
        if self.top_p < 1.0:
            probs = torch.softmax(vals, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            keep = int((torch.cumsum(probs, -1) < self.top_p).sum()) + 1
            vals, ids = vals[:keep], ids[:keep]
        if self.min_p > 0.0:
            probs = torch.softmax(vals, dim=-1)
            keep = max(1, int((probs >= self.min_p * probs[0]).sum()))
            vals, ids = vals[:keep], ids[:keep]
        probs = torch.softmax(vals / self.temp, dim=-1)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])
