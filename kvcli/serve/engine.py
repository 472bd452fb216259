"""The server's engine: slots, a bounded queue and the step loop (continuous batching). No HTTP.

Each of the -np slots owns a one-sequence cache of c / np cells, built as the Llama's own (which is
slot 0's), so every cache type, the window, the hidden-state cache and the kernels work unchanged;
K/V types that give `rows` views (every K/V type today: kvcli/cache/spec.py `has_rows`) make the slots rows of one
cache instead (`slot_caches`), so that a step's decode tokens attend as one batch.
One step (llama-server's update_slots) is one forward (Transformer.forward_slots, through the step's
slots as one cache: kvcli/serve/slots.py): a token for every decoding slot, then prompt chunks of the
slots being prefilled, up to -b tokens in all, each segment at its own positions, so the weights are
read once a step however many slots take part. A new request keeps the prefix its slot's cache shares
with its prompt. Over N pipeline stages (kvcli/pipeline.py) the busy slots are split into up to N
micro-batches, each a step of its own, launched while the others are in flight, so that every stage
works on one of them at once.

The loop runs in one thread (torch releases the GIL in its ops); requests arrive through `submit`
and report back through their `emit` callback, called on the engine thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvcli.cache import make_cache
from kvcli.cache.spec import has_rows
from kvcli.chat import common_prefix
from kvcli.errors import KvcliError
from kvcli.sampler import Sampler
from kvcli.memory import MIB, check_fits
from kvcli.serve.prompt_ram import PromptRam
from kvcli.serve.slots import run_step
from kvcli.weights import warm_up as weights_warm_up

GATHER_S = 0.05  # the longest an idle engine waits for a burst's requests being prepared (see Engine.preparing)

log = logging.getLogger("kvcli.serve")


class QueueFull(KvcliError):
    """Every slot is busy and the queue is full (the server answers 503)."""


@dataclass
class Piece:
    """Text that became final (a stop string can no longer start in it), and the tokens it came from."""
    text: str
    logprobs: list[dict] = field(default_factory=list)  # per token: {"id", "logprob", "top": [(id, logprob)]}


@dataclass
class Done:
    finish_reason: str  # "stop" (end of generation or a stop string) or "length" (max_tokens or slot context)
    prompt_n: int       # prompt tokens evaluated now
    cache_n: int        # prompt tokens reused from the slot's cache
    predicted_n: int
    prompt_ms: float
    predicted_ms: float


@dataclass
class Failed:
    message: str
    code: int = 500


@dataclass
class Request:
    """One completion. emit(event) is called on the engine thread with Piece, then Done or Failed."""
    prompt: list[int]
    emit: Callable[[object], None]
    sampler: Sampler = field(default_factory=lambda: Sampler(temp=0))
    max_tokens: int = -1  # -1: until end of generation or the slot's context end
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; n: the sampled token's log-probability and the n most likely
    cancelled: bool = False      # set from any thread (a client gone): the slot is freed at the next step


def partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that begins some stop string (held back until it resolves)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Slot:
    def __init__(self, index: int, cache):
        self.index, self.cache = index, cache
        self.cached: list[int] = []  # the token ids whose positions the cache holds, in order
        self.req: Request | None = None
        self.flying = False  # in a launched step whose logits are not back (Engine.flights)

    def start(self, req: Request, tokenizer) -> None:
        self.req = req
        # keep the prefix the cache shares with the prompt; at least one token is evaluated anew
        keep = min(common_prefix(self.cached, req.prompt), len(req.prompt) - 1)
        del self.cached[keep:]
        self.cache_n, self.todo = keep, req.prompt[keep:]
        self.history = list(req.prompt)  # what the sampler's repeat penalty sees
        self.stream = tokenizer.stream()
        self.text, self.sent, self.n_out, self.next_token = "", 0, 0, None
        self.prompt_s, self.t_gen = 0.0, None  # prompt seconds so far; when the first token was drawn
        self.logprobs: list[dict] = []

    def cells_bytes(self) -> tuple[int, int]:
        """(bytes in use, cells in use). A cell's bytes are the cache's bytes past its fixed part (the f16
        window, allocated whole and counted as in use) over its cells: the cache types are affine in cells."""
        fixed = self.cache.window_nbytes()
        per_cell = (self.cache.nbytes() - fixed) / self.cache.n_ctx
        return fixed + round(per_cell * len(self.cached)), len(self.cached)


def slot_caches(llm, n_slots: int) -> list:
    """One one-sequence cache per slot. K/V types with `rows` views (spec.has_rows): the rows of one
    n_slots-sequence cache, which replaces the Llama's own, so a step's decode tokens attend as one batch;
    the hidden-state cache (and a type without them): the Llama's cache (slot 0's) and n_slots - 1 more like
    it, each attending alone. The product kernels for n_slots decode rows are loaded with them."""
    spec = llm.cache_spec
    if n_slots > 1 and has_rows(spec):
        llm.cache = None  # freed before the slots' cache is made: never both at once
        if llm.pipe is not None:
            llm.pipe.cache = None
        base = make_cache(llm.config, spec, llm.n_ctx, n_slots, device=llm.device, attention=llm.attention,
                          model=llm.model)
        caches = [base.rows(i, i + 1) for i in range(n_slots)]
        llm.cache = caches[0]
    else:
        caches = [llm.cache] + [make_cache(llm.config, spec, llm.n_ctx, 1, device=llm.device,
                                           attention=llm.attention, model=llm.model) for _ in range(n_slots - 1)]
    if llm.pipe is not None:  # a pipeline stage: its slots' caches for the server's steps (Pipe.launch_step)
        llm.pipe.cache, llm.pipe.slot_caches = caches[0], caches
    if llm.device == "cpu":
        weights_warm_up(llm.model, n_slots)  # a step multiplies up to n_slots decode rows
    return caches


class Engine:
    """Slots over one Llama (its cache is slot 0's; its n_ctx is the slot context, c / np)."""

    def __init__(self, llm, n_slots: int, queue_size: int | None = None, ram: PromptRam | None = None):
        """ram: the host-RAM prompt cache (--cache-ram; None: off)."""
        if n_slots < 1:
            raise KvcliError(f"-np/--parallel takes 1 or more slots, not {n_slots}")
        self.llm, self.model, self.tok = llm, llm.model, llm.tokenizer
        self.n_ctx_slot = llm.n_ctx
        self.eog = self.tok.eog_ids
        if n_slots > 1 and llm.device == "cpu":  # the Llama checked weights + slot 0; the other slots here
            check_fits(0, llm.config, llm.cache_spec, llm.n_ctx, n_slots - 1,
                       what=f"{n_slots} slots of {llm.n_ctx} tokens")
        self.slots = [Slot(i, c) for i, c in enumerate(slot_caches(llm, n_slots))]
        staged = llm.pipe is not None and llm.pipe.stage.world > 1
        self.pipe = llm.pipe if staged else None  # over later stages (one stage of one rank: this process's model)
        self.depth = 1 if self.pipe is None else self.pipe.stage.world  # steps in flight at once: one a stage
        self.flights: deque[Flight] = deque()  # launched steps, oldest first
        self.fatal: str | None = None  # why the engine cannot go on (a pipeline rank lost): the server exits
        if self.pipe is not None:
            self.pipe.on_lost = self._lost
        self.queue_size = 4 * n_slots if queue_size is None else queue_size
        self.ram = ram
        self.pending: deque[Request] = deque()
        self.tasks: deque[tuple[Callable, Future]] = deque()  # work for the engine thread between steps (call)
        self.cond = threading.Condition()
        self.stopping = False
        self.announced = 0  # requests the HTTP side has begun to prepare (template, tokens) and not yet submitted
        # counters for /metrics (llama-server's), written on the engine thread only
        self.prompt_tokens_total = self.predicted_tokens_total = 0
        self.prompt_seconds_total = self.predicted_seconds_total = 0.0

    # ---- the other threads' side ----
    @contextlib.contextmanager
    def preparing(self):
        """Around a request's preparation (template, tokens) and its submit(req, ticket): an idle engine that gets a
        request while others are being prepared waits for them (GATHER_S at most), so that a burst's prompts share
        one prefill (the first alone, then the rest, costs a forward more); a lone request is not held."""
        ticket = [True]  # announced and not yet submitted
        with self.cond:
            self.announced += 1
        try:
            yield ticket
        finally:
            with self.cond:
                self._withdraw(ticket)

    def _withdraw(self, ticket: list | None) -> None:  # under self.cond
        if ticket and ticket[0]:
            ticket[0] = False
            self.announced -= 1
            self.cond.notify()

    def submit(self, req: Request, ticket: list | None = None) -> None:
        """Queue a request (ticket: its announcement, from preparing). QueueFull when every slot is busy and the
        queue holds queue_size already; KvcliError when the server is stopping or the prompt does not fit a slot."""
        if not req.prompt:
            raise KvcliError("the prompt is empty: it tokenizes to no tokens")
        if len(req.prompt) >= self.n_ctx_slot:
            raise KvcliError(f"the prompt is {len(req.prompt)} tokens, too long for a slot's context of "
                             f"{self.n_ctx_slot} tokens (-c / -np), which must also hold the reply")
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            idle = sum(s.req is None for s in self.slots)
            if len(self.pending) >= idle + self.queue_size:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {self.queue_size} requests already wait; "
                                f"try again later")
            self.pending.append(req)
            self._withdraw(ticket)
            self.cond.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread between two steps (a slot's save, restore or erase: no step then touches the
        caches); its result or exception in the future. QueueFull when the server is stopping."""
        fut: Future = Future()
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            self.tasks.append((fn, fut))
            self.cond.notify()
        return fut

    def _run_tasks(self) -> None:
        if self.flights:  # a task touches the caches: after the steps in flight have landed (step launches none)
            return
        while True:
            with self.cond:
                if not self.tasks:
                    return
                fn, fut = self.tasks.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    fut.set_exception(e)

    def stop(self) -> None:
        """Refuse new requests; the loop fails what waits or runs (its streams end) and returns."""
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _lost(self, message: str) -> None:
        """A pipeline rank found gone while idle (Pipe.on_lost, its own thread): the loop ends, the server exits."""
        self.fatal = message
        self.stop()

    def processing(self) -> int:
        return sum(s.req is not None for s in self.slots)

    def deferred(self) -> int:
        return len(self.pending)

    def cache_stats(self) -> dict:
        """Bytes and cells of all slots' caches, allocated and in use (Slot.cells_bytes says how)."""
        used = [s.cells_bytes() for s in self.slots]
        return {"bytes": sum(s.cache.nbytes() for s in self.slots), "bytes_in_use": sum(b for b, _ in used),
                "cells": self.n_ctx_slot * len(self.slots), "cells_in_use": sum(c for _, c in used)}

    def describe(self) -> str:
        """The start-up size line of all slots together, in the form of cache.describe()."""
        c0, n = self.slots[0].cache, len(self.slots)
        total = sum(s.cache.nbytes() for s in self.slots)
        head = (f"size = {total / MIB:7.2f} MiB ({self.n_ctx_slot * n:6d} cells, {c0.n_layers:3d} layers, "
                f"{n}/{n} seqs)")
        if hasattr(c0, "h"):
            parts = f"hidden cache: {head}, x ({c0.h.name}): {c0.h.nbytes() * n / MIB:7.2f} MiB"
        else:
            parts = (f"KV cache: {head}, K ({c0.k.name}): {c0.k.nbytes() * n / MIB:7.2f} MiB, "
                     f"V ({c0.v.name}): {c0.v.nbytes() * n / MIB:7.2f} MiB")
        if c0.window:
            parts += f", window {c0.window} (f16): {c0.window_nbytes() * n / MIB:7.2f} MiB"
        parts += f"; {n} slots of {self.n_ctx_slot} tokens"
        if hasattr(c0, "h") and c0.nbytes() > c0.kv_f16_bytes():  # as HiddenCache.describe
            parts += (f"\nwarning: the hidden-state cache is larger than an f16 K+V cache "
                      f"({c0.kv_f16_bytes() * n / MIB:.2f} MiB) for this model (GQA); --cache-mode kv is smaller")
        return parts

    # ---- the engine thread ----
    def run(self) -> None:
        """The loop: assign waiting requests to idle slots, step, until stop()."""
        while True:
            with self.cond:
                while (not self.stopping and not self.pending and not self.tasks and not self.flights
                       and all(s.req is None for s in self.slots)):
                    self.cond.wait()
                if self.stopping:
                    break
                if all(s.req is None for s in self.slots):  # idle until now: a burst's prompts prefilled together
                    deadline = time.perf_counter() + GATHER_S
                    while (self.announced and len(self.pending) < len(self.slots) and not self.stopping
                           and time.perf_counter() < deadline):
                        self.cond.wait(deadline - time.perf_counter())
                self._assign()
            self.step()
            self._run_tasks()
        while self.flights and self.fatal is None:  # the stages finish what they were given
            try:
                self._land(self.flights.popleft())
            except Exception:  # noqa: BLE001  (failed below with the rest)
                break
        self.flights.clear()
        self._run_tasks()  # what came before the stop still runs (a save's caller waits for it)
        with self.cond:
            waiting, self.pending = list(self.pending), deque()
        for r in waiting + [s.req for s in self.slots if s.req is not None]:
            r.emit(Failed("the server is shutting down", 503))
        for s in self.slots:
            s.req = None

    def _assign(self) -> None:
        """Waiting requests (oldest first) to idle slots: the one whose cache shares the longest prefix."""
        while self.pending:
            req = self.pending[0]
            if req.cancelled:
                self.pending.popleft()
                continue
            idle = [s for s in self.slots if s.req is None]
            if not idle:
                return
            self.pending.popleft()
            best = max(idle, key=lambda s: (common_prefix(s.cached, req.prompt), -s.index))
            if self.ram is not None:  # another conversation's longer prefix, from RAM into this slot
                tokens = self.ram.restore_longer(best.cache, best.cached, req.prompt)
                if tokens is not None:
                    best.cached = tokens
            best.start(req, self.tok)

    def step(self) -> None:
        """Launch steps for the busy slots not in flight (a token for every decoding slot, then prompt chunks, slots
        in order, up to -b tokens a step) while fewer than `depth` are in flight, then land the oldest."""
        for s in self.slots:
            if s.req is not None and s.req.cancelled and not s.flying:
                s.req = None  # what the cache holds stays valid: s.cached
        try:
            while len(self.flights) < self.depth and not self.tasks:
                segments = self._segments()
                if not segments:
                    break
                self.flights.append(self._launch(segments))
            if self.flights:
                self._land(self.flights.popleft())
        except Exception as e:  # a failed step fails its requests (their caches forgotten); the server goes on
            if not isinstance(e, KvcliError):
                log.exception("engine step failed")
            if self.pipe is not None and self.pipe.stopped.is_set():  # a rank is gone: no step can run again
                self.fatal = str(e)
                self.stop()
            self.flights.clear()
            for s in self.slots:
                s.flying = False
                if s.req is not None:
                    s.req.emit(Failed(f"generation failed: {e}"))
                    s.req, s.cached = None, []

    def _segments(self) -> list[tuple[Slot, list[int]]]:
        """The next step's (slot, tokens): the first of the ready slots (busy, not in flight) in index order, at most
        a `depth`-th of the busy ones (rounded up), so that the micro-batches in flight stay even in size."""
        ready = [s for s in self.slots if s.req is not None and not s.flying and not s.req.cancelled
                 and (s.todo or s.next_token is not None)]
        ready = ready[: -(-sum(s.req is not None for s in self.slots) // self.depth)]
        segments = [(s, [s.next_token]) for s in ready if not s.todo]
        budget = max(1, self.llm.batch_size - len(segments))
        for s in ready:
            if s.todo and budget > 0:
                segments.append((s, s.todo[:budget]))
                budget -= len(segments[-1][1])
        return segments

    def _launch(self, segments: list[tuple[Slot, list[int]]]) -> "Flight":
        t0 = time.perf_counter()
        ids, positions = [ids for _, ids in segments], [len(s.cached) for s, _ in segments]
        for s, _ in segments:
            s.flying = True
        if self.pipe is not None:  # over the stages: the logits come back when land() is called
            return Flight(segments, t0, self.pipe.launch_step(ids, [s.index for s, _ in segments], positions))
        logits = run_step(self.model, [s.cache for s, _ in segments], ids, positions)
        return Flight(segments, t0, lambda: logits)

    def _land(self, flight: "Flight") -> None:
        """A launched step's logits back: each slot's token sampled (or its prompt chunk counted)."""
        logits = flight.land().cpu()  # (n, V): one copy for every row's sampler (its generator is a CPU one)
        dt = time.perf_counter() - flight.t0
        segments = flight.segments
        if any(not s.todo for s, _ in segments):
            self.predicted_seconds_total += dt
        for (s, ids), row in zip(segments, logits):
            s.flying = False
            s.cached += ids
            if s.req is None or s.req.cancelled:  # cancelled in flight: what the cache holds stays valid
                s.req = None
                continue
            if not s.todo:  # decoding
                s.next_token = None
                self._take(s, row)
                continue
            s.todo = s.todo[len(ids):]
            s.prompt_s += dt
            if not s.todo:
                s.t_gen = time.perf_counter()
                self.prompt_tokens_total += len(s.req.prompt) - s.cache_n
                self.prompt_seconds_total += s.prompt_s
                self._take(s, row)

    def _take(self, s: Slot, logits: torch.Tensor) -> None:
        """Sample the slot's next token from logits (V,) f32 and report it, or finish the request."""
        req = s.req
        token = req.sampler.sample(logits, s.history)
        s.history.append(token)
        s.n_out += 1
        self.predicted_tokens_total += 1
        if req.logprobs is not None:
            lp = torch.log_softmax(logits.float(), -1)
            top = torch.topk(lp, req.logprobs) if req.logprobs else None
            s.logprobs.append({"id": token, "logprob": float(lp[token]),
                               "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))})
        if token in self.eog:
            s.text += s.stream.flush()
            return self._finish(s, "stop")
        s.text += s.stream.push(token)
        hit = min((i for i in (s.text.find(st, max(0, s.sent - len(st))) for st in req.stop) if i >= 0), default=-1)
        if hit >= 0:  # as llama.cpp: the output ends before the stop string
            s.text = s.text[:hit]
            return self._finish(s, "stop")
        if s.n_out == req.max_tokens or len(s.cached) >= self.n_ctx_slot:
            s.text += s.stream.flush()
            return self._finish(s, "length")
        end = len(s.text) - partial_stop(s.text, req.stop)
        if end > s.sent:
            req.emit(Piece(s.text[s.sent:end], s.logprobs))
            s.sent, s.logprobs = end, []
        s.next_token = token

    def _finish(self, s: Slot, reason: str) -> None:
        req, now = s.req, time.perf_counter()
        if len(s.text) > s.sent or s.logprobs:
            req.emit(Piece(s.text[s.sent:], s.logprobs))
        predicted_s = now - s.t_gen
        req.emit(Done(reason, len(req.prompt) - s.cache_n, s.cache_n, s.n_out, s.prompt_s * 1000, predicted_s * 1000))
        s.req, s.next_token = None, None
        if self.ram is not None:
            self.ram.put(s.cache, s.cached)


@dataclass
class Flight:
    """A launched step: its (slot, tokens) segments, when it started, and land() -> logits (n, V) f32."""
    segments: list
    t0: float
    land: Callable[[], torch.Tensor]


def timings(d: Done) -> dict:
    """llama-server's `timings` object of a finished request."""
    def per_second(n, ms):
        return n / ms * 1000 if ms > 0 else 0.0

    return {"cache_n": d.cache_n, "prompt_n": d.prompt_n, "prompt_ms": d.prompt_ms,
            "prompt_per_token_ms": d.prompt_ms / d.prompt_n if d.prompt_n else 0.0,
            "prompt_per_second": per_second(d.prompt_n, d.prompt_ms),
            "predicted_n": d.predicted_n, "predicted_ms": d.predicted_ms,
            "predicted_per_token_ms": d.predicted_ms / d.predicted_n if d.predicted_n else 0.0,
            "predicted_per_second": per_second(d.predicted_n, d.predicted_ms)}
