"""The Python API the CLI uses: `Llama("model.gguf", ctx_size=4096)`.

    from kvcli import Llama, Sampler
    llm = Llama(ctx_size=2048)  # the default model, fetched on first use, as `kvcli run`
    ids = llm.generate("The capital of France is", n_predict=16, sampler=Sampler(temp=0))
    print(llm.detokenize(list(ids)))
    llm.logits(llm.tokenize("The capital of France is"))  # (T, vocab) f32, fresh cache

Every error a caller can cause (a bad path, an empty prompt, an id outside the vocabulary, a
context that does not fit) is a KvcliError with one line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import torch

from kvcli.attention import Attention, warm_up as attention_warm_up
from kvcli.cache import CacheSpec, make_cache, state
from kvcli.errors import KvcliError
from kvcli.sampler import Sampler
from kvcli.timings import Timings
from kvcli.gguf_file import expected_shapes, open_gguf, optional_shapes, read_tensor
from kvcli.weights import WEIGHTS, joined_buffers, load, tensor_form
from kvcli.rope import rope_
from kvcli.weights import warm_up as weights_warm_up
from kvcli.weights import rms_norm
from kvcli.memory import check_fits, return_freed_memory
from kvcli.model import FUSED, Transformer, dtype_from_name
from kvcli.pull import pull_default
from kvcli.cache.layers import for_layers
from kvcli.shapes import random_forms, resident_weight_bytes, shape_config, synthetic_types, weight_bytes


class _DefaultModel:
    """`Llama()`'s model_path: a sentinel, so that leaving the path out means the default model
    while an explicit `Llama(None)` is an error (a forgotten variable, not a request)."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _DefaultModel()


def _model_file(model_path, log: Callable[[str], None] | None) -> str | os.PathLike:
    """The GGUF file `Llama` loads: model_path, or the default model (found, or fetched as `kvcli run`)."""
    if model_path is DEFAULT:
        return pull_default(log=log or (lambda line: print(line, file=sys.stderr)))
    if not isinstance(model_path, (str, os.PathLike)):
        raise KvcliError(f"model_path takes a GGUF file's path, not {model_path!r} "
                         f"(leave it out for the default model)")
    return model_path


class Llama:
    """A GGUF Llama-family model with its cache: tokenize, generate, logits.

    One cache of n_seq sequences and ctx_size tokens is allocated up front, of the chosen type
    (cache_mode kv: K/V of cache_type_k/_v; hidden: each layer's normed input as cache_type_h).
    `generate` and `eval` append to sequence 0; `logits` runs on a fresh cache.
    """

    def __init__(self, model_path: str | os.PathLike = DEFAULT, ctx_size: int = 4096, dtype: str = "f16",
                 cache_type_k: str = "f16", cache_type_v: str = "f16", batch_size: int = 512,
                 n_seq: int = 1, threads: int | None = None, flash_attn: bool = True,
                 device: str = "cpu", log: Callable[[str], None] | None = None, cache_mode: str = "kv",
                 cache_type_h: str = "f16", shape: str | None = None, weights: str = "native",
                 cache_window: int | None = None, cache_key_bias: str = "auto", cache_key_scales: str = "auto",
                 pipeline=None):
        """Load the model and allocate its cache.

        model_path: a GGUF file; left out, the default model (SmolLM2-135M-Instruct Q4_1) from the
            models folder ($KVCLI_MODELS, kvcli.catalog.models_dir), fetched there on first use.
        ctx_size: cache cells per sequence (0: the model's trained context).
        dtype: compute dtype, f32, f16 or bf16: of the activations, and of matrices kept dense
            under native weights (a type with no packed form).
        weights: native (each matrix in the resident form of its GGUF type, kvcli.weights: the ggml types in
            the file's blocks, others dense at dtype; a --shape model's matrices as Q4_0), f16 or
            f32 (every matrix dense; f32 is the exact reference).
        cache_type_k, cache_type_v, cache_type_h, cache_mode: the cache choice, as -ctk/-ctv/-cth/--cache-mode
            (cache_mode auto: hidden only where it is smaller than K+V).
        cache_window: the newest positions of each layer kept in f16 and quantized only when they leave,
            as --cache-window (kvcli/cache/window.py); None: the types' default (0 for llama.cpp's
            types); ignored (0) where every cache type is dense (f32, f16, bf16).
        cache_key_bias: auto, on or off, as --key-bias: keys stored less the model's K bias (kvcli/cache/key_bias.py).
        cache_key_scales: auto, on or off, as --key-scales: keys scaled for the queries (kvcli/cache/key_scale.py).
        batch_size: tokens per forward pass when prefilling.  n_seq: sequences the cache holds.
        threads: torch CPU threads (None: torch's choice).  flash_attn: the fused attention path.
        device: cpu or cuda.  log: called with each progress line (the cache's size; a fetch's).
        shape: a published configuration with random weights (kvcli.shapes), for speed and
            memory only; model_path is then ignored and there is no tokenizer.
        pipeline: (Stage, Pipe) from kvcli.pipeline.join: this process holds one stage's layers and their cache;
            on the first rank `generate`, `eval` and `logits` run through every stage.

        Raises KvcliError (one line): model_path None or not a path, a missing file, a directory, a
        file that is not a valid GGUF Llama model, a negative ctx_size, threads or cache_window, n_seq
        below 1, an unknown dtype or cache type, no CUDA for device cuda, a cache that does not fit in memory, a
        default model that cannot be fetched.
        """
        if threads is not None and threads < 0:
            raise KvcliError(f"threads takes a count of 1 or more (None: torch's choice), not {threads}")
        if ctx_size < 0 or n_seq < 1:
            raise KvcliError(f"ctx_size takes 0 (the trained context) or more and n_seq 1 or more, "
                             f"not {ctx_size} and {n_seq}")
        if threads:
            torch.set_num_threads(threads)
        threads = torch.get_num_threads()  # the count asked for (or set before), kept through the load below
        if dtype not in ("f32", "f16", "bf16"):
            raise KvcliError(f"unknown --dtype {dtype!r}; choose f32, f16 or bf16")
        if weights not in WEIGHTS:
            raise KvcliError(f"unknown weights {weights!r}; choose {', '.join(WEIGHTS)}")
        if device != "cpu" and not torch.cuda.is_available():
            raise KvcliError(f"device {device!r} asked for, but torch sees no CUDA GPU")
        self.synthetic, self.shape = shape is not None, shape
        if self.synthetic:
            self.gguf, self.config = None, shape_config(shape)
        else:
            self.gguf = open_gguf(_model_file(model_path, log))
            self.config = self.gguf.config
        c = self.config
        self.n_ctx = ctx_size if ctx_size > 0 else c.context_length
        self.batch_size, self.n_seq = max(1, batch_size), n_seq
        self.log = log or (lambda line: None)

        # kv, hidden or auto -> kv / hidden (auto: hidden only where smaller than K+V at these types)
        self.cache_spec = CacheSpec(cache_mode, cache_type_k, cache_type_v, cache_type_h,
                                    cache_window, cache_key_bias, cache_key_scales).resolved(c, self.n_ctx)
        self.stage, self.pipe = pipeline if pipeline is not None else (None, None)
        self._identity = None  # identity(), made on first use
        if self.stage is not None:  # this stage's layers alone, numbered from 0: its model and its cache
            layers, spec = self.stage.layers, self.cache_spec
            self.cache_spec = replace(spec, type_k=for_layers(spec.type_k, c.n_layers, layers),
                                      type_v=for_layers(spec.type_v, c.n_layers, layers))
            c = self.config = replace(c, n_layers=len(layers))
        self.cache_mode = self.cache_spec.mode
        self.attention = Attention(flash=flash_attn)  # how every cache of this run attends
        untied = not self.synthetic and "output.weight" in self.gguf.tensors
        types = synthetic_types(c) if self.synthetic else {n: t.tensor_type.name for n, t in self.gguf.tensors.items()}
        self.weights = weights
        if device == "cpu":
            if self.stage is None:
                resident = weight_bytes(c, dtype, untied, weights, types, device)
            else:  # this stage's tensors
                file_config = self.gguf.config
                resident = sum(b for n, b in resident_weight_bytes(file_config, dtype, untied, weights, types,
                                                                   device).items() if self.stage.wants(n, not untied))
            check_fits(resident, c, self.cache_spec, self.n_ctx, n_seq, what=f"a {self.n_ctx}-token context")

        self._tokenizer = None
        if not self.synthetic:
            try:  # built before the weights: its transient memory (freed again) then adds to a lower peak
                self.tokenizer
            except KvcliError:
                pass  # raised again where the tokenizer is used (bench and perplexity of ids need none)
        t0 = time.perf_counter()
        compute = dtype_from_name(dtype)
        if self.synthetic:  # native: Q4_0 blocks of the random weights, in the device's form
            tensors = dict(random_forms(c, weights, dtype, device))
        else:
            file_config = self.gguf.config
            names = list(expected_shapes(file_config)) + [n for n in optional_shapes(c) if n in self.gguf.tensors]
            if self.stage is not None:
                names = [n for n in names if self.stage.wants(n, not untied)]
            # Straight from the memory map to the resident form, one tensor at a time (peak: the
            # resident weights plus one tensor's copy); norms stay f32.
            tensors = {}
            forms = {n: tensor_form(self.gguf.tensors, n, weights, dtype, device) for n in names
                     if len(self.gguf.tensors[n].shape) > 1}
            groups = [tuple(f"blk.{i}.{m}" for m in group) for i in range(file_config.n_layers) for group in FUSED]
            into = joined_buffers(self.gguf.tensors, [g for g in groups if all(n in forms for n in g)], forms)
            for n in names:
                t = self.gguf.tensors[n]
                if len(t.shape) == 1:
                    tensors[n] = torch.from_numpy(read_tensor(self.gguf, n))
                else:
                    form = load(t, forms[n], dtype, into.get(n))
                    tensors[n] = form.to(device) if device != "cpu" else form
                    self.gguf.drop_pages()  # the file's pages read for it: peak = resident + one tensor
        self.device = device
        if self.stage is None:
            self.model = Transformer(c, tensors, compute, self.n_ctx).to(device)
        else:
            self.model = Transformer(c, tensors, compute, self.n_ctx, self.stage.layers, self.stage.first,
                                     self.stage.last).to(device)
        del tensors
        if not self.synthetic:  # fusing a layer's file blocks (q/k/v, gate/up) read their pages: copies now hold them
            self.gguf.drop_pages()
        return_freed_memory()  # the load's freed temporaries go back
        self.cache = self.new_cache(self.cache_spec)
        if device == "cpu" and self.cache_spec.mode == "kv":
            attention_warm_up(self.cache)  # the decode kernel loads with the model, not in the first token's time
        if device == "cpu":
            weights_warm_up(self.model, rows=1)  # so do decode's product kernel and the norm's pass
            if self.model.output_norm is not None:
                rms_norm(torch.zeros(1, c.n_embd), self.model.output_norm, c.rms_eps)
            for x in (torch.zeros(1, 1, 1, c.head_dim), torch.zeros(1, 2, 2, c.head_dim)[:, :, :1]):  # RoPE's pass,
                rope_(x, self.model.rot[: x.shape[1]], c.rope_neox)  # for decode's row and a batch's strided view
        if torch.get_num_threads() != threads:  # numba's OpenMP pool, started by the kernels' load, set the OpenMP
            torch.set_num_threads(threads)  # runtime torch shares to its own count: -t 1 ran on two cores
        # what a forward runs: the model, or on a pipeline's first rank every stage through the pipe
        self.run = self.model if self.pipe is None else self.pipe.forward
        if self.pipe is not None:
            self.pipe.ready(self.model, self.cache, self.identity())  # every stage loaded
        self.load_seconds = time.perf_counter() - t0
        if device == "cpu" and self.pipe is None:
            self._warm_decode()  # after the load time is taken, as llama.cpp's warm-up run
        self.log(self.cache.describe())
        self.n_past = 0  # positions filled in the cache (sequence 0 for generation)
        self.held: list[int] = []  # the ids at sequence 0's positions (the first n_past are valid)

    @property
    def tokenizer(self):
        """The model's kvcli.tokenizer.Tokenizer, built from the GGUF metadata on first use."""
        if self._tokenizer is None:
            from kvcli.tokenizer import Tokenizer

            if self.synthetic:
                raise KvcliError("a synthetic --shape model has random weights and no tokenizer")

            self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
            return_freed_memory()  # building it from the vocabulary's strings frees as much as it keeps
        return self._tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text`, BOS first when add_bos (None: the file's add_bos_token). special:
        control tokens written in the text (e.g. <|im_start|>) become their ids, as a CLI prompt."""
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens dropped. Raises KvcliError for an id outside the vocabulary."""
        return self.tokenizer.decode(ids)

    def reset(self) -> None:
        """Forget what sequence 0 holds: the next `generate` or `eval` starts at position 0."""
        self.n_past = 0

    def identity(self) -> dict:
        """The model as a state file names it (kvcli/cache/state.py): the GGUF file's identity, or the --shape."""
        if self._identity is None:
            self._identity = {"shape": self.shape} if self.synthetic else self.gguf.identity()
            if self.stage is not None:  # a pipeline rank's file holds its layers only
                self._identity = self._identity | {"stage": self.stage.describe()}
        return self._identity

    def save_state(self, path: str | os.PathLike, extra: dict | None = None) -> int:
        """Write sequence 0's cache, its n_past positions and their ids, to a state file (kvcli/cache/state.py);
        extra: more to keep in its header (the chat's messages). Returns the file's bytes."""
        size = state.save(path, self.identity(), self.cache, 0, self.held[: self.n_past], extra)
        if self.pipe is not None:  # each later rank its own layers', beside it (kvcli/pipeline.py Pipe.state)
            size += self.pipe.state("save", os.fspath(path), self.held[: self.n_past])
        return size

    def load_state(self, path: str | os.PathLike) -> tuple[list[int], dict]:
        """Read a state file into sequence 0: the next `generate` or `eval` appends after its tokens. Returns its
        token ids and the extra it was saved with. Raises KvcliError (the cache as it was) for a file of another
        model or cache, another format version, or a damaged one."""
        tokens, extra = state.load(path, self.identity(), self.cache, 0, self.config.vocab_size)
        self.loaded_bytes = os.path.getsize(path)  # the file's bytes (over stages: every rank's)
        if self.pipe is not None:  # the later ranks' files of the same tokens (a refusal ends the run)
            self.n_past, self.held = 0, []
            self.loaded_bytes += self.pipe.state("load", os.fspath(path), tokens)
        self.n_past, self.held = len(tokens), list(tokens)
        return tokens, extra

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise KvcliError(f"token id {bad} is outside the vocabulary: ids run 0..{self.config.vocab_size - 1}")

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Text is tokenized as the CLI's prompt (BOS per the file, control tokens parsed); ids pass."""
        ids = self.tokenize(prompt, special=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise KvcliError("nothing to evaluate: the prompt is empty" if isinstance(prompt, str)
                             else "nothing to evaluate: empty token list")
        return ids

    def _warm_decode(self) -> None:
        """Load the compiled decode layer's kernels (kvcli/decode_layer.py; numba's cache: ~0.3 s) with the model, not in
        the first tokens' time: a two-token prompt (its two compiled halves) and a decode token (the one-call layer)
        through a scratch cache of this run's choice and three positions."""
        scratch = make_cache(self.config, self.cache_spec, 3, 1, device=self.device, attention=self.attention,
                             model=self.model)
        self.model(torch.zeros(1, 2, dtype=torch.long), scratch, 0)
        self.model(torch.zeros(1, 1, dtype=torch.long), scratch, 2)

    def new_cache(self, spec: CacheSpec):
        """A cache of another choice, shaped and built as this run's own (sequences, context,
        device, attention): `logits(ids, cache=...)` runs through it with the same weights."""
        return make_cache(self.config, spec, self.n_ctx, self.n_seq, device=self.device, attention=self.attention,
                          model=self.model)

    def logits(self, ids: str | Sequence[int] | torch.Tensor, cache=None, first: int = 0,
               stop: int | None = None) -> torch.Tensor:
        """Fresh cache, prefill `ids` (T,) or (B, T) in batches; the logits of positions first..stop-1 (all by
        default) (n, V) or (B, n, V) f32, the others never made (the output head only for those rows). Text is
        tokenized first, as in `generate`. cache: one from `new_cache` to run through instead of the model's own
        (which then forgets sequence 0, as `reset`).

        Raises KvcliError: no tokens, ragged rows, more rows than n_seq, more than ctx_size tokens,
        an id outside the vocabulary."""
        tokens, single = self._token_rows(ids)
        stop = tokens.shape[1] if stop is None else min(stop, tokens.shape[1])
        out = None  # (B, stop - first, V), filled batch by batch: never a second copy
        for lo, logits in self._batches(tokens, cache, first, stop):
            if out is None:
                out = torch.empty(logits.shape[0], stop - first, logits.shape[-1], device=logits.device)
            out[:, lo : lo + logits.shape[1]] = logits
        return out[0] if single else out

    def logit_batches(self, ids: str | Sequence[int] | torch.Tensor, cache=None, first: int = 0,
                      stop: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """`logits` as its forward batches make them: (row offset from `first`, logits (B, r, V) f32) for each batch
        that reaches a row of first..stop-1, so a caller that reduces each one (perplexity at 32k: 16k scored rows of
        a 152k vocabulary, 10 GB whole) holds one batch's. Checked as `logits`, here, before the first forward."""
        tokens, _ = self._token_rows(ids)
        return self._batches(tokens, cache, first, tokens.shape[1] if stop is None else min(stop, tokens.shape[1]))

    def _token_rows(self, ids) -> tuple[torch.Tensor, bool]:
        """`logits`' ids, checked -> (tokens (B, T) long on the device, whether they came as one row)."""
        if isinstance(ids, str):
            ids = self._prompt_ids(ids)
        try:
            tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        except (ValueError, TypeError) as e:  # ragged rows, non-integers
            raise KvcliError(f"logits takes token ids as (T,) or (B, T): {e}") from None
        if tokens.dim() not in (1, 2):
            raise KvcliError(f"logits takes token ids as (T,) or (B, T), not shape {tuple(tokens.shape)}")
        if tokens.numel() == 0:
            raise KvcliError("nothing to evaluate: empty token list")
        single = tokens.dim() == 1
        tokens = tokens[None] if single else tokens
        if tokens.shape[0] > self.n_seq:
            raise KvcliError(f"{tokens.shape[0]} sequences given, the cache holds {self.n_seq}")
        if tokens.shape[1] > self.n_ctx:
            raise KvcliError(f"{tokens.shape[1]} tokens do not fit in the {self.n_ctx}-token context")
        self._check_ids(tokens)
        return tokens, single

    def _batches(self, tokens: torch.Tensor, cache, first: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        cache = self.cache if cache is None else cache
        n = tokens.shape[0]
        if n < self.n_seq:  # fill the cache's other sequences with copies; their logits are dropped
            tokens = torch.cat([tokens, tokens[-1:].expand(self.n_seq - n, -1)])
        for i in range(0, tokens.shape[1], self.batch_size):
            t = min(self.batch_size, tokens.shape[1] - i)
            keep = min(max(first - i, 0), t - 1)  # the batch's rows from here reach the head (at least one)
            if cache is not self.cache and self.pipe is not None:
                raise KvcliError("a pipeline's stages hold one cache each: another cache cannot run through them")
            logits = self.run(tokens[:, i : i + t], cache, i, from_row=keep)  # rows keep..t-1
            lo, hi = max(first, i + keep), min(stop, i + t)
            if hi > lo:
                yield lo - first, logits[:n, lo - i - keep : hi - i - keep]
            del logits
            if i + t < tokens.shape[1]:
                return_freed_memory()  # the heap's holes back between batches (see eval)
        if cache is self.cache:
            self.n_past = 0

    def _check_append(self, ids: list[int]) -> None:
        if not ids:
            raise KvcliError("nothing to evaluate: empty token list")
        if self.n_past + len(ids) > self.n_ctx:
            raise KvcliError(f"{self.n_past + len(ids)} tokens do not fit in the {self.n_ctx}-token context")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:  # on the list: no device sync per token
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise KvcliError(f"token id {bad} is outside the vocabulary: ids run 0..{self.config.vocab_size - 1}")

    def eval(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ids to sequence 0 at n_past (prefill in batches); logits of the last one (V,) f32.
        Raises KvcliError: no ids, past the context, an id outside the vocabulary."""
        ids = list(ids)
        self._check_append(ids)
        self.held[self.n_past :] = ids
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device)[None]
        for i in range(0, tokens.shape[1], self.batch_size):
            if i:  # a long prompt's batches free temporaries of ever-new sizes (attention's chunks grow with the
                return_freed_memory()  # position); glibc kept the holes: 5.5 GB at 16k before they went back
            logits = self.run(tokens[:, i : i + self.batch_size], self.cache, self.n_past, last_only=True)
            self.n_past += min(self.batch_size, tokens.shape[1] - i)
        return logits[0, -1]

    def generate(self, prompt: str | Sequence[int], n_predict: int = -1, sampler: Sampler | None = None,
                 timings: Timings | None = None, stop_at_eog: bool = True) -> Iterator[int]:
        """Evaluate `prompt` after what the cache holds, then yield up to n_predict sampled ids
        (-1: until end of generation or a full context). Stops after an end-of-generation token
        (yielded) unless stop_at_eog is False.

        prompt: text, tokenized as the CLI's prompt, or token ids.  sampler: kvcli.sampler.Sampler
        (default: llama.cpp's, temp 0.8).  timings: a kvcli.timings.Timings to fill.
        Raises KvcliError here, before the first id: an empty prompt, one past the context, an id
        outside the vocabulary."""
        ids = self._prompt_ids(prompt)
        self._check_append(ids)
        return self._generate(ids, n_predict, sampler or Sampler(), timings if timings is not None else Timings(),
                              stop_at_eog)

    def _generate(self, prompt: list[int], n_predict: int, sampler: Sampler, timings: Timings,
                  stop_at_eog: bool) -> Iterator[int]:
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
