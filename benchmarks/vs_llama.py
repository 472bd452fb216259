"""kvcli beside llama.cpp on the same GGUF file, in one run (issue 15's figures).

    LLAMA_BIN=/path/to/llama.cpp/build/bin python3 benchmarks/vs_llama.py [--model M] [--quick] [--reps N] [-- kvcli flags]

Prints, per cache type: tg128 and pp512 at depth 0 and 4096 (`llama-bench -t T -fa 1` against
`kvcli bench -t T`), each with the kvcli/llama.cpp ratio; then the peak RSS and load time of a
64-token run at -c 4096 (`llama-completion` against `kvcli run`, both under /usr/bin/time -v, the second of two
runs).
q4_hadamard has no llama.cpp counterpart: it is set beside llama.cpp's q4_0.
Flags after `--` go to every kvcli command (e.g. `-- --weights f16`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the city begins in the early middle ages, when"


def llama_bench(bin_dir: Path, model: str, cache: str, threads: int, args) -> dict:
    """(test, depth) -> t/s from llama-bench's JSON."""
    cmd = [str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-fa", "1", "-ctk", cache, "-ctv", cache,
           "-p", str(args.p), "-n", str(args.n), "-d", args.depths, "-r", str(args.r), "-o", "json"]
    env = dict(os.environ, LLAMA_ATTN_ROT_DISABLE="1")  # its plain q4_0/q8_0, as kvcli's ggml types
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, check=True).stdout
    rows = {}
    for r in json.loads(out):
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        rows[(test, r["n_depth"])] = r["avg_ts"]
    return rows


def kvcli_bench(model: str, cache: str, threads: int, args, extra: list[str]) -> dict:
    cmd = ["kvcli", "bench", "-m", model, "-t", str(threads), "-ctk", cache, "-ctv", cache, "-p", str(args.p),
           "-n", str(args.n), "-d", args.depths, "-r", str(args.r), "-o", "csv", *extra]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True).stdout
    # kvcli labels a depth run "tg32 @ d1024"; llama-bench keeps the depth in its own column
    return {(r["test"].split(" @")[0], int(r["depth"])): float(r["tokens_per_s"]) for r in csv.DictReader(io.StringIO(out))}


def peak_rss_and_load(cmd: list[str]) -> tuple[float, float | None]:
    """(peak RSS MiB, load time ms from the tool's own 'load time' line) of the second of two runs: the first warms
    the page cache and, for kvcli, compiles what the kernels' cache lacks (after a change to them: its compiler's
    memory in the peak), as llama-bench's warm-up run."""
    for _ in range(2):
        r = _timed(cmd)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    load = re.search(r"load time\s*=\s*([\d.]+) ms", r.stderr)
    return rss, float(load.group(1)) if load else None


def _timed(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       errors="replace")  # a random-weight model's text need not be UTF-8
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_hadamard")
    ap.add_argument("--quick", action="store_true", help="tg32/pp128, depths 0 and 1024, one repetition")
    ap.add_argument("--reps", type=int, help="repetitions of each test (default 3, --quick 1)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.p, args.n, args.depths, args.r = (128, 32, "0,1024", 1) if args.quick else (512, 128, "0,4096", 3)
    args.r = args.reps or args.r
    bin_dir = Path(os.environ.get("LLAMA_BIN", ""))
    if not (bin_dir / "llama-bench").exists():
        raise SystemExit("set LLAMA_BIN to llama.cpp's build/bin (llama-bench, llama-completion)")

    print(f"model {Path(args.model).name}, {args.threads} threads, kvcli flags: {' '.join(extra) or '-'}")
    print("| cache | test | depth | llama.cpp t/s | kvcli t/s | kvcli / llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for cache in args.types.split(","):
        theirs = llama_bench(bin_dir, args.model, "q4_0" if cache == "q4_hadamard" else cache, args.threads, args)
        ours = kvcli_bench(args.model, cache, args.threads, args, extra)
        for key in sorted(ours, key=lambda k: (k[0][:2] != "tg", k[1])):
            ref = theirs.get(key)
            ratio = f"{ours[key] / ref:.2f}x" if ref else "-"
            label = f"{cache} (vs q4_0)" if cache == "q4_hadamard" else cache
            print(f"| {label} | {key[0]} | {key[1]} | {ref or 0:.2f} | {ours[key]:.2f} | {ratio} |", flush=True)

    run = ["-p", PROMPT, "-n", "64", "-c", "4096", "--temp", "0", "-t", str(args.threads)]
    l_rss, l_load = peak_rss_and_load([str(bin_dir / "llama-completion"), "-m", args.model, *run, "-no-cnv"])
    k_rss, k_load = peak_rss_and_load(["kvcli", "run", "-m", args.model, *run, "-no-cnv", *extra])
    print(f"\npeak RSS, 64 tokens at -c 4096: llama-completion {l_rss:.0f} MiB, kvcli {k_rss:.0f} MiB "
          f"({k_rss / l_rss:.2f}x)")
    if l_load and k_load:
        print(f"load time: llama-completion {l_load:.0f} ms, kvcli {k_load:.0f} ms ({k_load / l_load:.2f}x)")


if __name__ == "__main__":
    main()
