"""A model's layers over several processes (issue 44): pipeline stages over torch.distributed, started by torchrun.

    torchrun --nproc-per-node 2 -m kvcli.cli run -m MODEL -p "..." --pipeline [--layer-split 10,14]

Rank r loads only its layers' tensors (the first rank also the embedding, the last the output norm and head; a tied
head's embedding there too) and holds only its layers' cache, of any type and mode. Rank 0 owns the command's input
and output. A forward is: rank 0 sends each rank a header (what to run: batch, tokens, position, which logits), embeds
the tokens and runs its layers; each rank passes the hidden state (B, T, n_embd) f32 to the next; the last applies
the norm and head and sends the logits back to rank 0. Only hidden states and logits cross: n_embd values a token.

Every rank checks before loading that all were started with the same model file (its identity), cache, context,
dtype and split, and says which rank differs. The step traffic has a timeout (a rank that dies or stops answering
ends the others within it, in one line naming the rank); rank 0 sends an idle header every few seconds while it
waits for input (a chat), so the others' wait for the next step never runs into the timeout.

A state file (--prompt-cache) over the stages is one file a rank, each of its own layers' cache: rank 0's at the path,
rank r's beside it at path.rank<r> (on its own machine), all of the same tokens, each naming its stage (`state`).

The server's steps (`launch_step`, a SLOTS header and a table of (slot, position, tokens) per segment) run the step's
segments of every slot as one batch on each stage, each rank over its own slots' caches. Rank 0 sends without waiting
(isend) and lands a step when its logits are back, so with more than one step in flight (the engine's micro-batches:
kvcli/serve/engine.py) the stages work on different steps at once.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from kvcli.errors import KvcliError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOAD_TIMEOUT_S = 900  # every rank loads (numba's first compile included) before the first step
STEP_TIMEOUT_S = 30  # a step's send, receive or header: past it, the rank waited on is taken as gone
IDLE_EVERY_S = 5  # rank 0's idle header while it waits for input
STOP, FORWARD, IDLE, SLOTS, STATE = 0, 1, 2, 3, 4  # header ops
HEADER = 6  # op, B, T, pos, last_only, from_row (int64); SLOTS: op, segments, tokens, 0, 0, 0


@dataclass(frozen=True)
class Stage:
    rank: int
    world: int
    layers: range  # the file's layers this rank holds

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def wants(self, name: str, tied: bool) -> bool:
        """Does this rank load the file's tensor `name`? tied: the model has no output.weight (the head is the
        embedding)."""
        if name.startswith("blk."):
            return int(name.split(".")[1]) in self.layers
        if name == "token_embd.weight":
            return self.first or (self.last and tied)
        if name in ("output.weight", "output_norm.weight"):
            return self.last
        return True  # rope_freqs.weight: every rank's RoPE table

    def describe(self) -> str:
        a, b = self.layers.start, self.layers.stop - 1
        return f"rank {self.rank} of {self.world}: layers {a}-{b}" + (", embedding" if self.first else "") + (
            ", output" if self.last else "")


def split(n_layers: int, world: int, given: str | None = None) -> list[range]:
    """Each rank's layers: even (the first ranks one more where they do not divide), or `given` as llama.cpp's
    --tensor-split reads: a count per rank (e.g. '10,14')."""
    if given is None:
        sizes = [n_layers // world + (r < n_layers % world) for r in range(world)]
    else:
        try:
            sizes = [int(x) for x in given.split(",")]
        except ValueError:
            raise KvcliError(f"--layer-split takes a layer count per rank, e.g. 10,14, not {given!r}") from None
        if len(sizes) != world or min(sizes) < 1 or sum(sizes) != n_layers:
            raise KvcliError(f"--layer-split {given}: {world} counts of 1 or more summing to the model's {n_layers} "
                             f"layers are needed")
    if world > n_layers:
        raise KvcliError(f"{world} pipeline stages for a {n_layers}-layer model: at most one stage a layer")
    out, a = [], 0
    for n in sizes:
        out.append(range(a, a + n))
        a += n
    return out


def join(n_layers: int, layer_split: str | None, facts: dict, device: str = "cpu") -> tuple[Stage, "Pipe"]:
    """Join the torchrun job: this rank's stage and its pipe, once every rank's facts (model identity, cache,
    context, flags) equal rank 0's."""
    import torch.distributed as dist

    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise KvcliError(f"--pipeline runs under torchrun (e.g. torchrun --nproc-per-node 2 -m kvcli.cli run ... "
                         f"--pipeline): {', '.join(missing)} not set")
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=LOAD_TIMEOUT_S))
        steps = dist.new_group(backend=backend, timeout=timedelta(seconds=STEP_TIMEOUT_S))
    except (RuntimeError, ValueError) as e:
        raise KvcliError(f"pipeline: cannot join the torchrun job: {_first_line(e)}") from None
    atexit.register(_leave)  # on any way out: an initialized group left at exit aborts the process (gloo's threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    stage = Stage(rank, world, split(n_layers, world, layer_split)[rank])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, facts | {"layer split": layer_split or "even"})
    for r, theirs in enumerate(everyone):
        for key in everyone[0]:
            if theirs.get(key) != everyone[0][key]:
                raise KvcliError(f"pipeline: rank {r} was started with another {key} ({theirs.get(key)}) than rank 0 "
                                 f"({everyone[0][key]}): every rank needs the same model file and flags")
    return stage, Pipe(stage, steps, device)


def start(path, layer_split: str | None, spec, ctx_size: int, dtype: str, weights: str, device: str,
          more: dict | None = None):
    """A command's --pipeline: join the job with the facts every rank must share (`more`: the command's own, e.g.
    the server's slots) -> ((Stage, Pipe), log), log the command's logger, prefixed with the rank on every rank but
    the first (theirs go to stderr beside rank 0's)."""
    from kvcli.commands.common import log
    from kvcli.gguf_file import open_gguf

    gguf = open_gguf(path)
    facts = {"model file": f"{os.path.basename(path)} (sha256 {gguf.identity()['sha256'][:12]})",
             "cache": f"{spec.mode} K {spec.type_k} V {spec.type_v} H {spec.type_h} window {spec.window} "
                      f"key bias {spec.key_bias}", "context": ctx_size, "dtype": dtype, "weights": weights,
             "device": device} | (more or {})
    stage, pipe = join(gguf.config.n_layers, layer_split, facts, device)
    say = log if stage.first else (lambda line: log(f"[rank {stage.rank}] {line}"))
    say(f"pipeline: {stage.describe()}")
    return (stage, pipe), say


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    """The reason in an error of torch.distributed, without gloo's source location and advice."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0]
    return line[:160]


class Pipe:
    """The step traffic of one stage. Rank 0: `forward` (what Llama runs its model with) and `stop`; the others:
    `serve` until rank 0 stops."""

    def __init__(self, stage: Stage, group, device: str):
        self.stage, self.group, self.device = stage, group, device
        self.lock = threading.Lock()  # a forward and the idle header never interleave
        self.sent_bytes = 0  # hidden states and logits this rank sent
        self.last = time.monotonic()
        self._idle: threading.Thread | None = None
        self.stopped = threading.Event()
        self.on_lost = None  # rank 0: called with the error when the idle header finds a rank gone (the server's exit)
        self._sending = None  # a later rank's (peer, isend work, tensor) not yet waited for (_send_on)
        self.slot_caches: list = []  # the server's slots' caches of this stage's layers (serve/engine.py slot_caches)

    def ready(self, model, cache, identity: dict | None = None) -> None:
        """Every rank has loaded (the load's long timeout): from here on, steps. identity: the model's as this rank's
        state files name it (Llama.identity: its stage's)."""
        import torch.distributed as dist

        self.model, self.cache, self.identity = model, cache, identity
        dist.barrier()
        if self.stage.first and self.stage.world > 1 and self._idle is None:
            self._idle = threading.Thread(target=self._keep_alive, name="kvcli-pipeline-idle", daemon=True)
            self._idle.start()

    def _call(self, what: str, peer: int, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:  # torch.distributed's errors: a peer gone (connection closed) or past the timeout
            self.stopped.set()
            raise KvcliError(f"pipeline: rank {self.stage.rank} lost rank {peer} ({what}): {_first_line(e)}") from None

    def _header(self, values: list[int] | None = None) -> list[int]:
        """Rank 0: send `values` to every other rank, one at a time (a failure then names the rank); the others:
        receive it."""
        import torch.distributed as dist

        h = torch.tensor(values or [0] * HEADER, dtype=torch.int64)
        if self.stage.first:
            for r in range(1, self.stage.world):
                self._call("sending a step", r, dist.send, h, r, self.group)
        else:
            self._call("waiting for the next step", 0, dist.recv, h, 0, self.group)
        return h.tolist()

    def _send(self, t: torch.Tensor, to: int) -> None:
        import torch.distributed as dist

        t = t.contiguous()
        self._call("sending", to, dist.send, t, to, self.group)
        self.sent_bytes += t.numel() * t.element_size()

    def _send_on(self, t: torch.Tensor, to: int) -> None:
        """A later rank's step result on its way (isend): the rank goes on to the next step while it travels; the
        one before it is waited for first (one in flight, in order)."""
        import torch.distributed as dist

        self._wait_sent()
        t = t.contiguous()
        self._sending = (to, self._call("sending", to, dist.isend, t, to, self.group), t)
        self.sent_bytes += t.numel() * t.element_size()

    def _wait_sent(self) -> None:
        if self._sending is not None:
            to, work, _ = self._sending
            self._sending = None
            self._call("sending", to, work.wait)

    def _recv(self, shape: tuple, frm: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import torch.distributed as dist

        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._call("receiving", frm, dist.recv, t, frm, self.group)
        return t

    def _send_json(self, obj, to: int) -> None:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self._send(torch.tensor([data.numel()], dtype=torch.int64), to)
        self._send(data, to)

    def _recv_json(self, frm: int):
        n = int(self._recv((1,), frm, torch.int64)[0])
        return json.loads(bytes(self._recv((n,), frm, torch.uint8).numpy()))

    def state(self, action: str, path: str, tokens: list[int]) -> int:
        """Rank 0: every later rank saves ("save") its layers' cache of sequence 0 holding `tokens` to path.rank<r>, or
        loads ("load") it from there, where its file must hold the same tokens -> the bytes of their files. A rank
        that cannot: KvcliError naming it (after a refused load the run cannot go on: the ranks' caches differ)."""
        total = 0
        with self.lock:
            self._header([STATE, 0, 0, 0, 0, 0])
            for r in range(1, self.stage.world):
                self._send_json({"action": action, "path": path, "tokens": tokens}, r)
            for r in range(1, self.stage.world):
                reply = self._recv_json(r)
                if "error" in reply:
                    raise KvcliError(f"pipeline: rank {r}: {reply['error']}")
                total += reply["bytes"]
            self.last = time.monotonic()
        return total

    def _serve_state(self) -> None:
        """A later rank's part of `state`: its own file, then a reply (the error's line where it cannot)."""
        from kvcli.cache import state

        req, mine = self._recv_json(0), None
        path = f"{req['path']}.rank{self.stage.rank}"
        try:
            if req["action"] == "save":
                reply = {"bytes": state.save(path, self.identity, self.cache, 0, req["tokens"])}
            else:
                mine, _ = state.load(path, self.identity, self.cache, 0, self.model.c.vocab_size)
                if mine != req["tokens"]:
                    raise KvcliError(f"state file {path} holds other tokens than rank 0's file (saved apart)")
                reply = {"bytes": os.path.getsize(path)}
        except KvcliError as e:
            reply = {"error": str(e)}
        self._send_json(reply, 0)

    def _keep_alive(self) -> None:
        while not self.stopped.wait(IDLE_EVERY_S / 2):
            with self.lock:
                if self.stopped.is_set() or time.monotonic() - self.last < IDLE_EVERY_S:
                    continue
                try:
                    self._header([IDLE, 0, 0, 0, 0, 0])
                except KvcliError as e:
                    if self.on_lost is not None:
                        self.on_lost(str(e))
                    return  # else the next forward reports it
                self.last = time.monotonic()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, pos: int, last_only: bool = False,
                from_row: int = 0) -> torch.Tensor:
        """Rank 0: Transformer.forward over every stage -> logits (B, T or 1 or T - from_row, vocab) f32."""
        model, s = self.model, self.stage
        if s.world == 1:
            return model(tokens, cache, pos, last_only, from_row)
        B, T = tokens.shape
        with self.lock:
            if self.stopped.is_set():
                raise KvcliError("pipeline: stopped after an earlier failure")
            self._header([FORWARD, B, T, pos, int(last_only), from_row])
            self._send(model.run_blocks(model.tok_embd.rows(tokens), cache, pos), 1)
            rows = 1 if last_only else T - from_row
            logits = self._recv((B, rows, model.c.vocab_size), s.world - 1)
            self.last = time.monotonic()
        return logits

    @torch.inference_mode()
    def launch_step(self, ids: list[list[int]], slots: list[int], positions: list[int]):
        """Rank 0 of two or more: start a server step over every stage (segment i: the tokens ids[i] of slot slots[i] at
        positions[i]..) and return at once after its own layers -> land(), which waits for the logits (len(ids),
        vocab) f32 of each segment's last token. Steps land in the order they were launched."""
        import torch.distributed as dist
        from kvcli.serve.slots import stage_step, step_tokens

        model, s = self.model, self.stage
        lengths = [len(t) for t in ids]
        caches = [self.slot_caches[i] for i in slots]
        tokens = step_tokens(ids, self.device)  # (1, N)
        table = torch.tensor([slots, positions, lengths], dtype=torch.int64).T.contiguous()  # (n, 3)
        header = torch.tensor([SLOTS, len(ids), tokens.shape[1], 0, 0, 0], dtype=torch.int64)
        with self.lock:
            if self.stopped.is_set():
                raise KvcliError("pipeline: stopped after an earlier failure")
            sends = []  # (peer, work, tensor kept alive until sent)
            for r in range(1, s.world):
                for t in (header, table):
                    sends.append((r, self._call("sending a step", r, dist.isend, t, r, self.group), t))
            logits = torch.empty((len(ids), model.c.vocab_size), dtype=torch.float32, device=self.device)
            back = self._call("receiving", s.world - 1, dist.irecv, logits, s.world - 1, self.group)
            self.last = time.monotonic()
        h = stage_step(model, caches, positions, lengths, model.tok_embd.rows(tokens)).contiguous()
        with self.lock:
            sends.append((1, self._call("sending", 1, dist.isend, h, 1, self.group), h))
            self.sent_bytes += h.numel() * h.element_size()

        def land() -> torch.Tensor:
            for peer, work, _ in sends:
                self._call("sending a step", peer, work.wait)
            self._call("receiving", s.world - 1, back.wait)
            self.last = time.monotonic()
            return logits

        return land

    @torch.inference_mode()
    def serve(self) -> None:
        """Ranks after the first: run this stage's layers on each step rank 0 starts, until it stops."""
        s, c = self.stage, self.model.c
        while True:
            op, B, T, pos, last_only, from_row = self._header()
            if op == STOP:
                self._wait_sent()
                return
            if op == IDLE:
                continue
            if op == SLOTS:
                self._serve_step(B, T)
                continue
            if op == STATE:
                self._serve_state()
                continue
            h = self.model.run_blocks(self._recv((B, T, c.n_embd), s.rank - 1), self.cache, pos)
            if s.last:
                self._send(self.model.head(h, bool(last_only), from_row), 0)
            else:
                self._send(h, s.rank + 1)

    def _serve_step(self, n: int, N: int) -> None:
        """A later rank's part of a server step (launch_step): its layers over its slots' caches, then on."""
        from kvcli.serve.slots import stage_step, step_logits

        s = self.stage
        slots, positions, lengths = self._recv((n, 3), 0, torch.int64).T.tolist()
        caches = [self.slot_caches[i] for i in slots]
        h = stage_step(self.model, caches, positions, lengths, self._recv((1, N, self.model.c.n_embd), s.rank - 1))
        if s.last:
            self._send_on(step_logits(self.model, h, lengths), 0)
        else:
            self._send_on(h, s.rank + 1)

    def stop(self) -> None:
        """Rank 0: end every later stage's `serve` (a new model may follow through `ready`); where a rank is gone
        already, nothing more to say (the error that found it is the one reported)."""
        if self.stage.first and self.stage.world > 1 and not self.stopped.is_set():
            with self.lock:
                try:
                    self._header([STOP, 0, 0, 0, 0, 0])
                except KvcliError:
                    pass

    def end(self) -> None:
        """Rank 0's last word (stop), then leave the job."""
        try:
            self.stop()
        finally:
            self.close()

    def close(self) -> None:
        """Leave the job (every rank, last)."""
        import torch.distributed as dist

        self.stopped.set()
        with self.lock:
            if dist.is_initialized():
                dist.destroy_process_group()
