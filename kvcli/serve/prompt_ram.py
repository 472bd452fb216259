"""llama-server's host-RAM prompt cache (`--cache-ram MiB`): finished requests' caches kept in their packed form
(the parts of a state file, kvcli/cache/state.py, copied), so that a request on any slot starts from the longest
prefix any earlier conversation computed, not only its own slot's. Least recently used entries go first when the
budget is full; an entry whose tokens begin a newer one's is replaced by it (a conversation's later turn)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcli.cache import state
from kvcli.chat import common_prefix


@dataclass
class Entry:
    tokens: list[int]
    tensors: list[torch.Tensor]  # state.parts(cache, 0, len(tokens))'s tensors, copies
    nbytes: int


class PromptRam:
    def __init__(self, budget: int | None):
        """budget: bytes the entries may hold (None: no limit)."""
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.nbytes = self.lookups = self.hits = self.evictions = 0
        self._next = 0

    def put(self, cache, tokens: list[int]) -> None:
        """Keep a copy of what cache's sequence holds at tokens' positions (on the engine thread)."""
        if not tokens:
            return
        pieces = state.parts(cache, 0, len(tokens))
        size = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)
        if self.budget is not None and size > self.budget:
            return
        for key, e in list(self.entries.items()):
            if len(e.tokens) <= len(tokens) and e.tokens == tokens[: len(e.tokens)]:  # superseded
                self._drop(key)
        self.entries[self._next] = Entry(list(tokens), [p.tensor.clone() for p in pieces], size)
        self._next += 1
        self.nbytes += size
        while self.budget is not None and self.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def restore_longer(self, cache, cached: list[int], prompt: list[int]) -> list[int] | None:
        """If an entry shares more of prompt than cached (what the slot's cache holds) does, write it into cache's
        sequence and return its tokens (the slot's new `cached`); else None."""
        self.lookups += 1
        own = common_prefix(cached, prompt)
        best, shared = None, own
        for key, e in self.entries.items():
            n = common_prefix(e.tokens, prompt)
            if n > shared:
                best, shared = key, n
        if best is None:
            return None
        e = self.entries[best]
        self.entries.move_to_end(best)
        state.put(cache, state.parts(cache, 0, len(e.tokens)), e.tensors)
        self.hits += 1
        return list(e.tokens)

    def stats(self) -> dict:
        return {"budget_bytes": self.budget, "bytes": self.nbytes, "entries": len(self.entries),
                "lookups": self.lookups, "hits": self.hits, "evictions": self.evictions,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0}
