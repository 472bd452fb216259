"""The Python API the CLI uses: `Llama("model.gguf", ctx_size=4096)`.

    llm = Llama("models/SmolLM2-135M-Instruct.Q4_1.gguf", ctx_size=2048)
    ids = llm.tokenize("The capital of France is")
    for token in llm.generate(ids, n_predict=16, sampler=Sampler(temp=0)): ...
    llm.logits(ids)  # (T, vocab) f32, fresh cache
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator, Sequence

import torch

from kvcli.attention import Attention
from kvcli.cache import CacheSpec, make_cache
from kvcli.errors import KvcliError
from kvcli.generate import Sampler, Timings
from kvcli.gguf_file import expected_shapes, open_gguf, optional_shapes, read_tensor
from kvcli.memory import check_fits
from kvcli.model import Transformer, dtype_from_name
from kvcli.shapes import random_weights, shape_config, weight_bytes


class Llama:
    def __init__(self, model_path: str | os.PathLike | None, ctx_size: int = 4096, dtype: str = "f16",
                 cache_type_k: str = "f16", cache_type_v: str = "f16", batch_size: int = 512,
                 n_seq: int = 1, threads: int | None = None, flash_attn: bool = True,
                 device: str = "cpu", log: Callable[[str], None] | None = None, cache_mode: str = "kv",
                 cache_type_h: str = "f16", shape: str | None = None):
        """shape: a published configuration with random weights (kvcli.shapes), for speed and
        memory only; model_path is then ignored and there is no tokenizer."""
        if threads:
            torch.set_num_threads(threads)
        if dtype not in ("f32", "f16", "bf16"):
            raise KvcliError(f"unknown --dtype {dtype!r}; choose f32, f16 or bf16")
        if device != "cpu" and not torch.cuda.is_available():
            raise KvcliError(f"device {device!r} asked for, but torch sees no CUDA GPU")
        self.synthetic = shape is not None
        if self.synthetic:
            self.gguf, self.config = None, shape_config(shape)
        else:
            self.gguf = open_gguf(model_path)
            self.config = self.gguf.config
        c = self.config
        self.n_ctx = ctx_size if ctx_size > 0 else c.context_length
        self.batch_size, self.n_seq = max(1, batch_size), n_seq
        self.log = log or (lambda line: None)

        # kv, hidden or auto -> kv / hidden (auto: hidden only where smaller than K+V at these types)
        self.cache_spec = CacheSpec(cache_mode, cache_type_k, cache_type_v, cache_type_h).resolved(c, self.n_ctx)
        self.cache_mode = self.cache_spec.mode
        self.attention = Attention(flash=flash_attn)  # how every cache of this run attends
        untied = not self.synthetic and "output.weight" in self.gguf.tensors
        if device == "cpu":
            check_fits(weight_bytes(c, dtype, untied), c, self.cache_spec, self.n_ctx, n_seq,
                       what=f"a {self.n_ctx}-token context")

        t0 = time.perf_counter()
        compute = dtype_from_name(dtype)
        if self.synthetic:
            weights = dict(random_weights(c, compute, device))
        else:
            names = list(expected_shapes(c)) + [n for n in optional_shapes(c) if n in self.gguf.tensors]
            # Matrices go to the compute dtype one by one (peak: one f32 matrix, not the model); norms stay f32.
            weights = {n: (w if w.dim() == 1 else w.to(compute))
                       for n in names for w in [torch.from_numpy(read_tensor(self.gguf, n))]}
        self.device = device
        self.model = Transformer(c, weights, compute, self.n_ctx).to(device)
        del weights
        self.cache = self.new_cache(self.cache_spec)
        self.load_seconds = time.perf_counter() - t0
        self.log(self.cache.describe())
        self.n_past = 0  # positions filled in the cache (sequence 0 for generation)
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from kvcli.tokenizer import Tokenizer

            if self.synthetic:
                raise KvcliError("a synthetic --shape model has random weights and no tokenizer")

            self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        return self._tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def reset(self) -> None:
        self.n_past = 0

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise KvcliError(f"token id out of range 0..{self.config.vocab_size - 1}")

    def new_cache(self, spec: CacheSpec):
        """A cache of another choice, shaped and built as this run's own (sequences, context,
        device, attention): `logits(ids, cache=...)` runs through it with the same weights."""
        return make_cache(self.config, spec, self.n_ctx, self.n_seq, device=self.device, attention=self.attention,
                          model=self.model)

    def logits(self, ids: Sequence[int] | torch.Tensor, cache=None) -> torch.Tensor:
        """Fresh cache, prefill `ids` (T,) or (B, T) in batches; all logits (T, V) or (B, T, V) f32.
        cache: one from `new_cache` to run through instead of the model's own."""
        cache = self.cache if cache is None else cache
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        single = tokens.dim() == 1
        tokens = tokens[None] if single else tokens
        if tokens.shape[0] > self.n_seq:
            raise KvcliError(f"{tokens.shape[0]} sequences given, the cache holds {self.n_seq}")
        if tokens.shape[1] > self.n_ctx:
            raise KvcliError(f"{tokens.shape[1]} tokens do not fit in the {self.n_ctx}-token context")
        self._check_ids(tokens)
        n = tokens.shape[0]
        if n < self.n_seq:  # fill the cache's other sequences with copies; their logits are dropped
            tokens = torch.cat([tokens, tokens[-1:].expand(self.n_seq - n, -1)])
        out = [self.model(tokens[:, i : i + self.batch_size], cache, i)
               for i in range(0, tokens.shape[1], self.batch_size)]
        if cache is self.cache:
            self.n_past = 0
        logits = torch.cat(out, dim=1)[:n]
        return logits[0] if single else logits

    def eval(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ids to sequence 0 at n_past (prefill in batches); logits of the last one (V,)."""
        if not ids:
            raise KvcliError("nothing to evaluate: empty token list")
        if self.n_past + len(ids) > self.n_ctx:
            raise KvcliError(f"{self.n_past + len(ids)} tokens do not fit in the {self.n_ctx}-token context")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:  # on the list: no device sync per token
            raise KvcliError(f"token id out of range 0..{self.config.vocab_size - 1}")
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device)[None]
        for i in range(0, tokens.shape[1], self.batch_size):
            logits = self.model(tokens[:, i : i + self.batch_size], self.cache, self.n_past, last_only=True)
            self.n_past += min(self.batch_size, tokens.shape[1] - i)
        return logits[0, -1]

    def generate(self, prompt: Sequence[int], n_predict: int = -1, sampler: Sampler | None = None,
                 timings: Timings | None = None, stop_at_eog: bool = True) -> Iterator[int]:
        """Evaluate `prompt` after what the cache holds, then yield up to n_predict sampled ids
        (-1: until end of generation or a full context). Stops at an end-of-generation token."""
        sampler = sampler or Sampler()
        timings = timings if timings is not None else Timings()
        history = list(prompt)
        t0 = time.perf_counter()
        logits = self.eval(list(prompt))
        timings.add_prompt(len(prompt), time.perf_counter() - t0)
        eog = self.tokenizer.eog_ids if stop_at_eog else frozenset()
        produced = 0
        while n_predict < 0 or produced < n_predict:
            token = sampler.sample(logits, history)
            history.append(token)
            produced += 1
            yield token
            if token in eog or produced == n_predict:  # the last token is not evaluated
                return
            if self.n_past >= self.n_ctx:
                timings.context_full = True
                return
            t0 = time.perf_counter()
            logits = self.eval([token])
            timings.add_eval(1, time.perf_counter() - t0)
